"""DFlash drafter for Qwen3-8B (design §11): 5 full-attention layers, 32/8 heads x 128, I=12288, B=16, γ=7.

    python -m dflash_jax.train --config configs/qwen3_8b.py --workdir /ckpt/dflash-qwen3-8b \
        --config.target_dir=/ckpt/Qwen3-8B --config.data.train_files=/data/train.jsonl
"""

from dflash_jax.train.config import base_config


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
    config.epochs = 6  # the published recipes' 6 passes over the corpus; total_steps follows from its size
    config.data.anchor_stride = 16  # 256 anchors per row
    config.data.batch_size = 8
    return config
