"""A tiny CPU configuration: a 2-layer drafter over any small Qwen3 target, short rows, few steps.

    python -m dflash_jax.train --config configs/tiny.py --workdir /tmp/dflash-tiny \
        --config.target_dir=PATH_TO_SMALL_QWEN3 --config.data.train_files=data.jsonl
"""

from dflash_jax.train.config import base_config


def get_config():
    config = base_config()
    config.target_dtype = "float32"
    config.drafter.num_hidden_layers = 2
    config.drafter.num_attention_heads = 4
    config.drafter.num_key_value_heads = 2
    config.drafter.head_dim = 16
    config.drafter.layer_types = ("sliding_attention", "full_attention")
    config.drafter.sliding_window = 32
    config.drafter.num_feature_layers = 2
    config.drafter.block_size = 8
    config.loss.gamma = 4.0
    config.data.seq_len = 128
    config.data.anchor_stride = 8
    config.data.batch_size = 4
    config.total_steps = 50
    config.loss.vocab_chunk = 512
    config.loss.row_chunk = 64
    config.query_chunk_blocks = 4
    config.log_every = 5
    config.checkpoint_every = 25
    return config
