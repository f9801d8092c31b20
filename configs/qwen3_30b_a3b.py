"""Qwen3-30B-A3B (`qwen3_moe`, design §8.5): the target's shapes, and the DFlash drafter trained against it.

48 layers, H=2048, attention 32/4 heads x 128, every layer 128 routed experts of width 768 with 8 per token
(renormalised, no shared expert), V=151936, θ=1e6, untied LM head.

The drafter has the published Qwen3-30B-A3B DFlash drafter's depth, feature layers and mask token (5 layers,
[1, 12, 23, 34, 45], 151669); the rest follows the z-lab Qwen3 drafters (design §11), which the published
figures do not contradict: all full attention, 32/8 heads x 128, I = 6144 (the target's dense
`intermediate_size`, also 3·H as drafters of MoE targets take), B=16, γ=7, θ=1e6. The schedule is the
SpecForge DFlash recipe of `qwen3_8b.py` (rows of 3072 tokens, 512 anchors on a stride-6 grid, 6 epochs,
AdamW 6e-4 with 4% warmup then cosine, b2 0.999, D-PACE position weights), with one row per device as the 27B's
recipe: the target's 30B weights, not its activations, fill the device.

How long (planned, docs/scaling_and_launching.md "MoE targets"): 6 epochs of 1.6 billion tokens take 4.3-7.5 hours
on v5p-64 with a copy of the target per chip, if the hardware reaches the roofline's range.

    dflash-jax train --config qwen3_30b_a3b --workdir /ckpt/dflash-qwen3-30b-a3b \
        --config.target_dir=/ckpt/Qwen3-30B-A3B --config.data.train_files=/data/train.jsonl
"""

from dflash_jax.models.moe_config import MoeSettings
from dflash_jax.models.qwen3 import Qwen3Config
from dflash_jax.train.config import base_config

LAYERS = 48


def target_config() -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=LAYERS,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960,
                       moe=MoeSettings(num_experts=128, top_k=8, expert_intermediate_size=768, normalize_top_k=True,
                                       sparse_layers=(True,) * LAYERS))


def get_config():
    config = base_config()
    config.drafter.num_hidden_layers = 5
    config.drafter.num_attention_heads = 32
    config.drafter.num_key_value_heads = 8
    config.drafter.head_dim = 128
    config.drafter.intermediate_size = 6144
    config.drafter.layer_types = ("full_attention",) * 5
    config.drafter.num_feature_layers = 5
    config.drafter.target_layer_ids = (1, 12, 23, 34, 45)  # = design §2's default for L = 48
    config.drafter.rope_theta = 1e6
    config.drafter.mask_token_id = 151669
    config.drafter.block_size = 16
    config.loss.gamma = 7.0
    config.data.seq_len = 3072
    config.data.anchor_stride = 6  # N = 512 anchors per row
    config.data.rows_per_device = 1
    config.epochs = 6  # total_steps follows from the corpus's size (train/epochs.py)
    config.optim.b2 = 0.999
    return config
