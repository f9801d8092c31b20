"""Shapes the planning tests compile: the 27B recipe with fewer target layers."""

from __future__ import annotations

import dataclasses

from configs import qwen27b


def qwen27b_layers(num_layers: int):
    """configs/qwen27b.py's config and its target's published shapes cut to the first `num_layers` layers."""
    full = qwen27b.target_config()
    return qwen27b.get_config(), dataclasses.replace(full, num_hidden_layers=num_layers,
                                                     layer_types=full.layer_types[:num_layers])


def narrowed(config, target_config, hidden_size: int = 1024, intermediate_size: int = 3072,
             vocab_size: int = 32768):
    """The same layers at a narrower width and vocabulary: the 27B's layer pattern and attention heads, what a
    deviceless TPU compile takes minutes on at full width (the mask token moved into the smaller vocabulary)."""
    config.drafter.mask_token_id = vocab_size - 1
    return config, dataclasses.replace(target_config, hidden_size=hidden_size, intermediate_size=intermediate_size,
                                       vocab_size=vocab_size)
