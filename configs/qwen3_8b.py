"""DFlash drafter for Qwen3-8B (design §11): 5 full-attention layers, 32/8 heads x 128, I=12288, B=16, γ=7: the
shape of z-lab's Qwen3-8B-DFlash-b16.

The recipe is the published DFlash one (design §11): rows of 4096 tokens with 512 anchors (a static grid of
stride 8, design §4, where the published trainers sample 512 anchor positions), 6 epochs, AdamW at lr 6e-4 with
4% warmup then cosine, clipping 1.0, γ = 7, on target-regenerated data. Departures and their reasons: AdamW's b2
is 0.999, as speculators trains (torch's default); the batch is one row per device (data.rows_per_device), so
the config runs on any number of devices. The position weights are D-PACE (the trainer's default, as in
speculators and SpecForge), chosen by the toy measurement in bench/RESULTS.md.

    dflash-jax train --config qwen3_8b --workdir /ckpt/dflash-qwen3-8b \
        --config.target_dir=/ckpt/Qwen3-8B --config.data.train_files=/data/train.jsonl
"""

from dflash_jax.train.config import base_config, placeholder


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
    config.data.seq_len = 4096
    config.data.anchor_stride = 8  # N = 512 anchors per row
    config.data.batch_size = placeholder(int)  # given per device instead (an int field still, for overrides)
    config.data.rows_per_device = 1
    config.epochs = 6  # total_steps follows from the corpus's size (train/epochs.py)
    config.optim.b2 = 0.999
    return config
