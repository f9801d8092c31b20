"""The target -> drafter pair forward (design §3-§6), one code path for the train step and exact τ, with the
block ids and features the speculative generator feeds the drafter too.

`target_context` runs the frozen target over rows and gives the drafter everything it reads: the feature
layers, the labels of the drafted slots k >= 1 (argmax of the target's own logits at a+k-1, or the data's
next tokens; slot 0 is never trained), the target's embedding of the block ids (slot 0 the real token at the
anchor, the others mask_token_id) and the LM head. `Drafter.__call__` (models/drafter.py) then runs on it
with the rows' `DrafterInputs`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.models.target import TargetOutput
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.lm_head import greedy_labels
from dflash_jax.sharding import LM_HEAD, ROWS_EMBED, constrain

LABEL_SOURCES = ("target", "data")


class TargetContext(NamedTuple):
    """What the frozen target gives the drafter for a batch of rows; no gradient flows into any of it."""

    features: jax.Array  # [b, T, n*H] the feature layers, concatenated in target_layer_ids order
    # [b, N, D] int32: the token each drafted slot of the block at anchor a predicts (`drafted_slots`: D = B-1
    # slots k = 1..B-1, or D = B for "dspark")
    labels: jax.Array
    block_embeds: jax.Array  # [b, N*B, H] the target's embedding of the block ids
    lm_head: jax.Array  # [H, V]
    # [b, N, D, H] the target's final-normed hidden state before each drafted slot's label, whose logits are its
    # distribution for that slot; only when the loss compares distributions (design §18), else None
    label_hidden: jax.Array | None = None


def drafted_slots(grid: AnchorGrid, from_anchor: bool = False) -> np.ndarray:
    """[N, D] the row positions of the tokens the drafted slots predict, clipped to the row (slots past its
    end are never trained): a+k for the DFlash slots k = 1..B-1 (D = B-1; slot 0 holds the anchor's own token
    and is never trained, so neither its label nor its logits are computed), or with `from_anchor` a+k+1 for
    every slot k = 0..B-1 (D = B, DSpark's layout, design §18). Either way a+1..a+D."""
    count = grid.block_size if from_anchor else grid.block_size - 1
    return np.minimum(grid.anchors[:, None] + np.arange(1, count + 1)[None, :], grid.seq_len - 1)


def target_labels(hidden: jax.Array, lm_head: jax.Array, grid: AnchorGrid, vocab_chunk: int,
                  from_anchor: bool = False) -> jax.Array:
    """[b, N, D] the target's greedy token at i-1 for the drafted slot whose label sits at i (`drafted_slots`).
    hidden: the target's final-normed hidden states [b, T, H]; lm_head: [H, V]."""
    label_source = drafted_slots(grid, from_anchor) - 1
    if label_source.size >= grid.seq_len:  # slots overlap (S < B): one argmax per row position is cheaper
        return greedy_labels(hidden, lm_head, vocab_chunk)[:, label_source]
    labels = greedy_labels(hidden[:, label_source.reshape(-1)], lm_head, vocab_chunk)
    return labels.reshape(hidden.shape[0], *label_source.shape)


def drafter_features(out: TargetOutput) -> jax.Array:
    """The target's feature layers [b, T, n, H] as the drafter's fc reads them, [b, T, n*H]."""
    return out.features.reshape(*out.features.shape[:2], -1)


def block_embeddings(target, input_ids: jax.Array, grid: AnchorGrid, mask_token_id: int) -> jax.Array:
    """[b, N*B, H] the target's embedding of the block ids (slot 0 the anchor's token, slots 1..B-1 the mask
    token) from N + 1 looked-up rows, the anchors' and the mask token's, instead of N*B: the mask token's row
    stands in every block's B - 1 mask slots."""
    anchors = target.embed(input_ids[:, grid.anchors])  # [b, N, H]
    mask = target.embed(jnp.full((1, 1), mask_token_id, input_ids.dtype))[0, 0]  # [H]
    anchor_slot = (jnp.arange(grid.block_size) == 0)[None, None, :, None]
    blocks = jnp.where(anchor_slot, anchors[:, :, None, :], mask.astype(anchors.dtype))  # [b, N, B, H]
    return blocks.reshape(input_ids.shape[0], grid.num_queries, -1)


def target_context(target, input_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array, grid: AnchorGrid,
                   config: DrafterConfig, *, labels: str = "target", vocab_chunk: int = 8192,
                   with_distribution: bool = False) -> TargetContext:
    """The target over rows [b, T] and what the drafter reads of it (see the module docstring);
    with_distribution: also the hidden states behind its distribution at the drafted slots (`label_hidden`).
    The drafted slots are those of config.method: k = 1..B-1, or every slot for "dspark" (design §18)."""
    out = target(input_ids, positions, segment_ids, config.target_layer_ids)
    lm_head = constrain(target.lm_head_kernel(), LM_HEAD)  # gathered once for the labels and the loss
    from_anchor = config.drafter_method.drafts_anchor_slot
    if labels == "data":
        slot_labels = input_ids[:, drafted_slots(grid, from_anchor)]
    else:
        slot_labels = target_labels(out.hidden, lm_head, grid, vocab_chunk, from_anchor)
    label_hidden = out.hidden[:, drafted_slots(grid, from_anchor) - 1] if with_distribution else None
    return jax.lax.stop_gradient(TargetContext(
        constrain(drafter_features(out), ROWS_EMBED), constrain(slot_labels, ("activation_batch", None, None)),
        constrain(block_embeddings(target, input_ids, grid, config.mask_token_id), ROWS_EMBED), lm_head,
        label_hidden))
