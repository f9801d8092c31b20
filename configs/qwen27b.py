"""Qwen3.6-27B (same architecture as Qwen3.5-27B): the target's text-model shapes (design §8.2, §11), and
the DFlash drafter trained against it (design §11).

64 layers = 16 × [Gated DeltaNet ×3, gated attention], H=5120, MLP 17408, attention 24/4 heads × 256 (q_proj
out 12288 with the gate), GDN 16 key / 48 value heads × 128, conv 4, V=248320, RoPE θ=1e7 on the first 25%
of each head, untied LM head. 26,895,998,464 text parameters.
"""

from dflash_jax.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3_5Config
from dflash_jax.train.config import base_config


def target_config() -> Qwen3_5Config:
    return Qwen3_5Config(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION) * 16,
        rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25, tie_word_embeddings=False,
        max_position_embeddings=262144)


def get_config():
    """design §11 drafter for Qwen3.6-27B: 5 layers ([sliding W=2048] x 4, full), 32/8 heads x 128, I=17408,
    feature ids [1,16,31,46,61], mask token 248070, B=16, γ=7, rope θ 1e7.

    The recipe is SpecForge's Qwen3.6-27B online DFlash recipe: rows of 4096 tokens with 512 anchors (here a
    static grid of stride 8, design §4, where SpecForge samples 512 anchor positions), 6 epochs, AdamW at lr
    6e-4 with 4% warmup then cosine, clipping 1.0, γ = 7, on target-regenerated data (README, step 1: docs/data.md).
    Departures and their reasons: AdamW's b2 is 0.999, as speculators trains (torch's default); the batch is
    one row per device (data.rows_per_device), so the config runs on any slice size, its global batch growing
    with the slice. The position weights are D-PACE (the trainer's default, as SpecForge's `loss_type: dpace` and
    speculators' default), chosen by the toy measurement in bench/RESULTS.md.

        dflash-jax train --config qwen27b --workdir /ckpt/dflash-qwen27b \\
            --config.target_dir=/ckpt/Qwen3.6-27B --config.data.train_files=/data/train.jsonl
    """
    config = base_config()
    config.drafter.num_hidden_layers = 5
    config.drafter.num_attention_heads = 32
    config.drafter.num_key_value_heads = 8
    config.drafter.head_dim = 128
    config.drafter.intermediate_size = 17408
    config.drafter.layer_types = ("sliding_attention",) * 4 + ("full_attention",)
    config.drafter.sliding_window = 2048
    config.drafter.num_feature_layers = 5
    config.drafter.target_layer_ids = (1, 16, 31, 46, 61)  # = design §2's default for L = 64
    config.drafter.rope_theta = 1e7  # plain 1-D RoPE on the full head_dim, not the target's partial MRoPE
    config.drafter.mask_token_id = 248070
    config.drafter.block_size = 16
    config.loss.gamma = 7.0
    config.data.seq_len = 4096
    config.data.anchor_stride = 8  # N = 512 anchors per row
    config.data.rows_per_device = 1
    config.epochs = 6  # total_steps follows from the corpus's size (train/epochs.py)
    config.optim.b2 = 0.999
    return config
