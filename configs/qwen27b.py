"""Qwen3.6-27B (same architecture as Qwen3.5-27B): the target's text-model shapes (qwen_arch.md §3.1/§3.2).

64 layers = 16 × [Gated DeltaNet ×3, gated attention], H=5120, MLP 17408, attention 24/4 heads × 256 (q_proj
out 12288 with the gate), GDN 16 key / 48 value heads × 128, conv 4, V=248320, RoPE θ=1e7 on the first 25%
of each head, untied LM head. 26,895,998,464 text parameters.
"""

from dflash_jax.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3_5Config


def target_config() -> Qwen3_5Config:
    return Qwen3_5Config(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION) * 16,
        rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25, tie_word_embeddings=False,
        max_position_embeddings=262144)
