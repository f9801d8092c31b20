"""Model FLOPs of one train step and the MFU they give (design §6).

Counted: the target forward (every weight matmul on every row position, causal attention on its softmax
attention layers, the LM head on the label positions when labels come from the target) and the drafter
forward + backward (3x the forward on trained weights: fc on the context, the layers on the block tokens,
context k/v projections, the §5-masked attention; 2x for the frozen LM head, whose weight gets no
gradient). Rematerialisation, padding and masked-out work are not counted, as usual for MFU. A hybrid target's
Gated DeltaNet layers add their chunked delta rule's matmuls (`delta_rule_flops`).
"""

from __future__ import annotations

import jax
import numpy as np
from ml_collections import ConfigDict

from dflash_jax.planning.chips import chip_of_kind
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.models.qwen3_5_config import LINEAR_ATTENTION
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.train.config import anchor_grid
from dflash_jax.ops.gated_delta import CHUNK_SIZE

def peak_tflops(config: ConfigDict, device: jax.Device) -> float | None:
    """config.peak_tflops_per_device, else the published bf16 peak of this device kind (chips.py), else None
    (MFU unknown)."""
    if config.peak_tflops_per_device:
        return float(config.peak_tflops_per_device)
    chip = chip_of_kind(device.device_kind)
    return None if chip is None else chip.bf16_flops / 1e12


def visible_keys(grid: AnchorGrid, window: int | None) -> int:
    """Number of (query, key) pairs of one row the §5 mask lets through (position part)."""
    anchors = grid.anchors[:, None].astype(np.int64)
    slots = np.arange(grid.block_size)[None, :]
    if window is None:  # context p < a, whole own block
        context = np.broadcast_to(anchors, (grid.num_anchors, grid.block_size))
        block = grid.block_size
    else:  # a + k - W < p < a, causal within the block
        context = np.clip(np.minimum(anchors, window - 1 - slots), 0, None)
        block = slots + 1
    return int(np.sum(context + block))


def delta_rule_flops(target_config, length: int) -> float:
    """Matmul FLOPs of the chunked gated delta rule (ops/gated_delta.py, design §8.3) over one row of `length`
    tokens in all of a hybrid target's Gated DeltaNet layers; 0 for a dense target.

    Per value head and chunk of C tokens (dk, dv the head widths): A = (β⊙K)Kᵀ and QKᵀ 2C²dk each, the
    solve T[βV | βDK] 2C²(dv + dk), the attention on the corrections 2C²dv, the inverse by blocked substitution
    Σ_s 4s³ · C/(2s) ≈ 2C³/3, and the state carried across chunks (WS, KᵀU, QS) 6C·dk·dv.
    """
    layers = sum(kind == LINEAR_ATTENTION for kind in getattr(target_config, "layer_types", ()))
    if not layers:
        return 0.0
    c, dk, dv = CHUNK_SIZE, target_config.linear_key_head_dim, target_config.linear_value_head_dim
    chunks = -(-length // c)
    inverse = sum(4.0 * s**3 * c / (2 * s) for s in (2**i for i in range(c.bit_length() - 1)))
    per_chunk = 2.0 * c * c * (3 * dk + 2 * dv) + inverse + 6.0 * c * dk * dv
    return layers * target_config.linear_num_value_heads * chunks * per_chunk


def train_step_flops(config: ConfigDict, target_config, drafter_config: DrafterConfig) -> float:
    """FLOPs of one optimizer step over config.data.batch_size rows."""
    grid = anchor_grid(config)
    rows, length, queries = config.data.batch_size, grid.seq_len, grid.num_queries
    hidden, vocab = target_config.hidden_size, target_config.vocab_size

    target = 2.0 * target_config.layer_matmul_params * length
    target += 2.0 * length * length * target_config.num_attention_heads * target_config.head_dim \
        * target_config.attention_layers  # QK^T and PV, half of the T x T pairs (causal): 2 * 2 * T^2 / 2
    target += delta_rule_flops(target_config, length)
    if config.loss.labels == "target":
        target += 2.0 * hidden * vocab * min(length, queries)

    c = drafter_config
    kv_width = c.num_key_value_heads * c.head_dim
    drafter = 2.0 * len(c.target_layer_ids) * hidden * hidden * length  # fc
    drafter += 2.0 * c.layer_matmul_params * queries  # q/k/v/o and MLP on the block tokens
    drafter += 2.0 * 2 * hidden * kv_width * c.num_hidden_layers * length  # k/v of the context
    drafter += sum(4.0 * c.num_attention_heads * c.head_dim * visible_keys(grid, c.window(i))
                   for i in range(c.num_hidden_layers))
    head = 2.0 * hidden * vocab * queries
    return rows * (target + 3.0 * drafter + 2.0 * head)
