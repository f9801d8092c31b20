"""The tiny training config the tests share, in a module without torch: config files that the tests write for a
command's process import it from here, and a command's process has no torch (dflash_jax/commands/entry.py)."""

from __future__ import annotations

from pathlib import Path

from ml_collections import ConfigDict

from configs import tiny


def tiny_config(target_dir: Path, train_file: Path, **overrides) -> ConfigDict:
    """configs/tiny.py on 64-token rows (8 anchors of 8 slots), fp32 everywhere so results are exact."""
    config = tiny.get_config()
    config.target_dir = str(target_dir)
    config.data.train_files = (str(train_file),)
    config.target_dtype = "float32"
    config.compute_dtype = "float32"
    config.data.seq_len = 64
    config.data.anchor_stride = 8
    config.drafter.block_size = 8
    config.drafter.sliding_window = 24
    config.loss.row_chunk = 24  # not a divisor of N*B = 64: exercises the padded last chunk
    config.loss.vocab_chunk = 200  # not a divisor of V = 640: exercises the remainder chunk
    config.mesh = ConfigDict(dict(data=1, fsdp=1, tensor=1))
    config.target_layout = "fsdp"  # `build` makes the step itself, without the plan that settles "auto"
    for key, value in overrides.items():
        target = config
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target[parent]
        target[leaf] = value
    return config
