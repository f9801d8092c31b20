"""Qwen3.6-35B-A3B (`qwen3_5_moe`, the same shapes as Qwen3.5-35B-A3B; design §8.2, §8.5): the target's
text-model shapes, and the DFlash drafter trained against it.

40 layers = 10 x [Gated DeltaNet x3, gated attention], H=2048, attention 16/2 heads x 256 (RoPE θ=1e7 on the
first 25% of each head), GDN 16 key / 32 value heads x 128, conv 4, every layer 256 routed experts of width 512
with 8 per token (always renormalised) plus a shared expert of width 512 under its sigmoid gate, V=248320,
untied LM head; no dense MLP.

The drafter is z-lab's Qwen3.6-35B-A3B DFlash drafter of the June 2026 schema: 6 layers (5 sliding W=4096, then
1 full), 8 feature layers [1, 6, 11, 16, 22, 27, 32, 37] (design §2's default for L = 40, n = 8), 8 KV heads x
128, mask token 248077, B=16, plain 1-D RoPE θ=1e7. Not published with it, and taken from z-lab's other
drafters: 32 query heads, and I = 3·H = 6144 (their Qwen3.5-122B-A10B drafter's I is 3·H too; the target has
no dense MLP width to copy). γ=7 and the schedule are those of `qwen27b.py` (rows of 4096 tokens,
512 anchors on a stride-8 grid, one row per device, 6 epochs, AdamW 6e-4 with 4% warmup then cosine, b2 0.999,
D-PACE position weights).

How long (planned, docs/scaling_and_launching.md "MoE targets"): 6 epochs of 1.6 billion tokens take 6.3-9.5 hours
on v5p-64 (a copy of the target per chip), 10-12 hours on v6e-64 (experts over tensor = 4) and 4.1-5.6 hours on
4 x 8 H200, if the hardware reaches the roofline's range.

    dflash-jax train --config qwen36_35b_a3b --workdir /ckpt/dflash-qwen36-35b-a3b \
        --config.target_dir=/ckpt/Qwen3.6-35B-A3B --config.data.train_files=/data/train.jsonl
"""

from dflash_jax.models.moe_config import MoeSettings
from dflash_jax.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3_5Config
from dflash_jax.train.config import base_config

LAYERS = 40


def target_config() -> Qwen3_5Config:
    return Qwen3_5Config(
        vocab_size=248320, hidden_size=2048, intermediate_size=0, num_hidden_layers=LAYERS,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION) * 10,
        rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25, tie_word_embeddings=False,
        max_position_embeddings=262144,
        moe=MoeSettings(num_experts=256, top_k=8, expert_intermediate_size=512, normalize_top_k=True,
                        sparse_layers=(True,) * LAYERS, shared_expert_intermediate_size=512))


def get_config():
    config = base_config()
    config.drafter.num_hidden_layers = 6
    config.drafter.num_attention_heads = 32
    config.drafter.num_key_value_heads = 8
    config.drafter.head_dim = 128
    config.drafter.intermediate_size = 6144
    config.drafter.layer_types = ("sliding_attention",) * 5 + ("full_attention",)
    config.drafter.sliding_window = 4096
    config.drafter.num_feature_layers = 8
    config.drafter.target_layer_ids = (1, 6, 11, 16, 22, 27, 32, 37)
    config.drafter.rope_theta = 1e7  # plain 1-D RoPE on the full head_dim, not the target's partial MRoPE
    config.drafter.mask_token_id = 248077
    config.drafter.block_size = 16
    config.loss.gamma = 7.0
    config.data.seq_len = 4096
    config.data.anchor_stride = 8  # N = 512 anchors per row
    config.data.rows_per_device = 1
    config.epochs = 6  # total_steps follows from the corpus's size (train/epochs.py)
    config.optim.b2 = 0.999
    return config
