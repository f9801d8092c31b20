"""Shapes the planning tests compile: the 27B recipe with fewer target layers."""

from __future__ import annotations

import dataclasses

from configs import qwen27b


def qwen27b_layers(num_layers: int):
    """configs/qwen27b.py's config and its target's published shapes cut to the first `num_layers` layers."""
    full = qwen27b.target_config()
    return qwen27b.get_config(), dataclasses.replace(full, num_hidden_layers=num_layers,
                                                     layer_types=full.layer_types[:num_layers])
