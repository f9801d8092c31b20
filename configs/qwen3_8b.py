"""Qwen3-8B (its config.json's shapes, design §8.1) and the DFlash drafter trained against it (design §11): 5
full-attention layers, 32/8 heads x 128, I=12288, B=16, γ=7: the shape of z-lab's Qwen3-8B-DFlash-b16.

The recipe is SpecForge's Qwen3-8B online DFlash recipe: rows of 3072 tokens, 4 rows per GPU, 512 anchors (here a
static grid of stride 6, design §4, where SpecForge samples 512 anchor positions), 6 epochs, AdamW at lr 6e-4
with 4% warmup then cosine, clipping 1.0, γ = 7, on target-regenerated data (README, step 1: docs/data.md).
Departures and their reasons: AdamW's b2 is 0.999, as speculators trains (torch's default); the batch is 4 rows per
device (data.rows_per_device) rather than per GPU of an 8-GPU job, so the config runs on any slice size, its global
batch growing with the slice. The position weights are D-PACE (the trainer's default, as in speculators and
SpecForge), chosen by the toy measurement in bench/RESULTS.md.

    dflash-jax train --config qwen3_8b --workdir /ckpt/dflash-qwen3-8b \
        --config.target_dir=/ckpt/Qwen3-8B --config.data.train_files=/data/train.jsonl
    dflash-jax plan --config configs/qwen3_8b.py --topology v5p-8 --compare --layouts replicate,fsdp,tensor
"""

from dflash_jax.models.qwen3 import Qwen3Config
from dflash_jax.train.config import base_config


def target_config() -> Qwen3Config:
    """Qwen/Qwen3-8B's config.json: 36 layers, H=4096, MLP 12288, 32/8 heads x 128, V=151936, untied, θ=1e6."""
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960)


def get_config():
    config = base_config()
    config.drafter.num_hidden_layers = 5
    config.drafter.num_attention_heads = 32
    config.drafter.num_key_value_heads = 8
    config.drafter.head_dim = 128
    config.drafter.intermediate_size = 12288
    config.drafter.layer_types = ("full_attention",) * 5
    config.drafter.num_feature_layers = 5  # -> [1, 9, 17, 25, 33] for L = 36
    config.drafter.rope_theta = 1e6
    config.drafter.mask_token_id = 151669
    config.drafter.block_size = 16
    config.loss.gamma = 7.0
    config.data.seq_len = 3072
    config.data.anchor_stride = 6  # N = 512 anchors per row
    config.data.rows_per_device = 4
    config.epochs = 6  # total_steps follows from the corpus's size (train/epochs.py)
    config.optim.b2 = 0.999
    return config
