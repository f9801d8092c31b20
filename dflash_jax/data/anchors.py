"""The static anchor grid and its per-row masks (design §4), in jax.numpy so they run inside a jitted step.

Anchors sit at a_j = j*S for j < N = T/S in every row; the loader's phase shift moves the content instead of
the grid, so everything indexed by anchors here has static shapes. Inputs are [batch, T] arrays (NumPy or
JAX); `anchors` is the static NumPy array `AnchorGrid.anchors` (ops/mask.py). Slot k of block j sits at
position a_j + k and is flattened as index j*B + k in [batch, N*B] outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _slot_indices(seq_len: int, anchors: np.ndarray, block_size: int) -> tuple[jax.Array, jax.Array]:
    """[N, B] row index a+k of every slot, clipped into the row, and whether it was in the row at all."""
    index = jnp.asarray(anchors)[:, None] + jnp.arange(block_size)[None, :]
    return jnp.minimum(index, seq_len - 1), index < seq_len


def anchor_validity(loss_mask: jax.Array | np.ndarray, anchors: np.ndarray) -> jax.Array:
    """[batch, N] bool: anchor a is valid iff loss_mask[a] == 1, loss_mask[a+1] == 1 and a+1 < T."""
    trained = jnp.asarray(loss_mask).astype(bool)
    anchors = jnp.asarray(anchors)
    next_index = anchors + 1
    next_in_row = next_index < trained.shape[1]
    next_trained = trained[:, jnp.minimum(next_index, trained.shape[1] - 1)]
    return trained[:, anchors] & next_trained & next_in_row[None, :]


def slot_mask(
    loss_mask: jax.Array | np.ndarray,
    segment_ids: jax.Array | np.ndarray,
    anchors: np.ndarray,
    block_size: int,
) -> jax.Array:
    """[batch, N, B] bool: slot k is trained iff k >= 1, the anchor is valid, a+k < T,
    segment_ids[a+k] == segment_ids[a] and loss_mask[a+k] == 1."""
    trained = jnp.asarray(loss_mask).astype(bool)
    segment_ids = jnp.asarray(segment_ids)
    index, in_row = _slot_indices(trained.shape[1], anchors, block_size)
    same_document = segment_ids[:, index] == segment_ids[:, jnp.asarray(anchors)][:, :, None]
    not_anchor_slot = jnp.arange(block_size) >= 1
    valid = anchor_validity(trained, anchors)[:, :, None]
    return valid & in_row[None] & not_anchor_slot[None, None, :] & same_document & trained[:, index]


def block_token_ids(
    input_ids: jax.Array | np.ndarray, anchors: np.ndarray, block_size: int, mask_token_id: int
) -> jax.Array:
    """[batch, N*B]: slot 0 holds input_ids[a], slots 1..B-1 hold mask_token_id."""
    input_ids = jnp.asarray(input_ids)
    anchor_ids = input_ids[:, jnp.asarray(anchors)][:, :, None]
    is_anchor_slot = (jnp.arange(block_size) == 0)[None, None, :]
    blocks = jnp.where(is_anchor_slot, anchor_ids, jnp.asarray(mask_token_id, input_ids.dtype))
    return blocks.reshape(input_ids.shape[0], -1)


def block_positions(positions: jax.Array | np.ndarray, anchors: np.ndarray, block_size: int) -> jax.Array:
    """[batch, N*B]: positions[a] + k, the RoPE position of each block slot."""
    positions = jnp.asarray(positions)
    offsets = jnp.arange(block_size, dtype=positions.dtype)[None, None, :]
    return (positions[:, jnp.asarray(anchors)][:, :, None] + offsets).reshape(positions.shape[0], -1)


def block_segment_ids(segment_ids: jax.Array | np.ndarray, anchors: np.ndarray, block_size: int) -> jax.Array:
    """[batch, N*B]: segment_ids[a] for every slot of the block at anchor a."""
    segment_ids = jnp.asarray(segment_ids)
    return jnp.repeat(segment_ids[:, jnp.asarray(anchors)], block_size, axis=1)


def anchor_utilisation(valid: jax.Array | np.ndarray) -> jax.Array:
    """Fraction of anchors that are valid (valid / all): the price of the static grid."""
    return jnp.mean(jnp.asarray(valid).astype(jnp.float32))
