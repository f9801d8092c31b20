"""The DFlash attention mask (design §5) on the static anchor grid (design §4, ops/anchors.py).

Queries are the N*B block tokens (query j*B + k is slot k of block j, anchor a_j = j*S); keys are the T
context positions followed by the N*B block tokens. The mask is a static position part, which depends only
on (T, S, B, W) and is built here once in NumPy, AND a document part: context key p is visible only if
segment_ids[p] == segment_ids[a_j]. Block keys need no document check (a block only sees itself).

`window=None` selects a full-attention layer (context p < a_j, bidirectional block); an int W selects a
sliding-window layer (context a_j + k - W < p < a_j, causal block), which is what vLLM executes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops.anchors import AnchorGrid


def validate_window(window: int | None) -> None:
    """None (full attention) or a positive int W (sliding window); anything else is a configuration error."""
    if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"window must be None (full attention) or a positive int, got {window!r}")


# The two rules below take broadcastable index arrays, NumPy or JAX, so the static NumPy masks here and the
# chunked attention (which evaluates them in-graph on each chunk's own rows and keys) share one definition.

def context_rule(query_anchor, query_slot, key, window: int | None):
    """Context key p visible from slot k of the block at anchor a: p < a, and a + k - W < p if sliding."""
    visible = key < query_anchor  # strict: the anchor's own feature does not exist at inference (§12.4)
    if window is not None:
        visible = visible & (key > query_anchor + query_slot - window)
    return visible


def block_rule(query_index, key_index, block_size: int, causal: bool):
    """Block key visible from block query (flat indices j*B + k): same block, and k' <= k if causal."""
    visible = query_index // block_size == key_index // block_size
    if causal:
        visible = visible & (key_index <= query_index)
    return visible


def context_visible(grid: AnchorGrid, window: int | None) -> np.ndarray:
    """[N*B, T] bool, position part of the context keys: p < a_j, and a_j + k - W < p on sliding layers."""
    validate_window(window)
    return context_rule(grid.query_anchors[:, None], grid.query_slots[:, None], np.arange(grid.seq_len)[None],
                        window)


def block_visible(grid: AnchorGrid, causal: bool) -> np.ndarray:
    """[N*B, N*B] bool: same block only; causal (slot k' <= k) on sliding layers, else bidirectional."""
    index = np.arange(grid.num_queries)
    return block_rule(index[:, None], index[None, :], grid.block_size, causal)


def position_mask(grid: AnchorGrid, window: int | None) -> np.ndarray:
    """[N*B, T + N*B] bool: the whole static position part, context keys then block keys."""
    return np.concatenate([context_visible(grid, window), block_visible(grid, causal=window is not None)],
                          axis=1)


def dense_mask(grid: AnchorGrid, segment_ids: jax.Array | np.ndarray, window: int | None) -> jax.Array:
    """[batch, N*B, T + N*B] bool: the dense oracle of design §5, the reference for every attention backend.

    segment_ids: [batch, T] document ids of the packed row (padding has an id no real token shares).
    """
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.ndim != 2 or segment_ids.shape[1] != grid.seq_len:
        raise ValueError(f"segment_ids must be [batch, {grid.seq_len}], got shape {segment_ids.shape}")
    batch = segment_ids.shape[0]
    query_segment = segment_ids[:, grid.query_anchors]  # [batch, N*B]: the document of each query's anchor
    same_document = query_segment[:, :, None] == segment_ids[:, None, :]
    context = jnp.asarray(context_visible(grid, window))[None] & same_document
    block = jnp.broadcast_to(block_visible(grid, causal=window is not None), (batch,) + (grid.num_queries,) * 2)
    return jnp.concatenate([context, block], axis=2)


def visible_intervals(grid: AnchorGrid, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """[N*B, 2] starts and [N*B, 2] ends: each query's visible keys of the position part as two half-open
    intervals of key indices, its context keys (a_j + k - W < p < a_j, or p < a_j) and its block keys (offset
    by T; causal on sliding layers). The same rules as `position_mask` without its [N*B, T + N*B] array."""
    validate_window(window)
    query = np.arange(grid.num_queries, dtype=np.int64)
    anchor, slot = grid.query_anchors.astype(np.int64), grid.query_slots.astype(np.int64)
    context_start = np.zeros_like(anchor) if window is None else np.maximum(anchor + slot - window + 1, 0)
    block_start = grid.seq_len + query - slot
    block_end = block_start + (grid.block_size if window is None else slot + 1)
    starts = np.stack([np.minimum(context_start, anchor), block_start], axis=1)
    return starts, np.stack([anchor, block_end], axis=1)


def tile_fraction(grid: AnchorGrid, window: int | None, q_tile: int, k_tile: int) -> float:
    """Fraction of (query-tile, key-tile) pairs of the position mask holding at least one visible entry.

    This is the share of tiles a block-sparse kernel computes (the document part only removes more). Edge
    tiles that overhang the mask count as tiles. Read from each query's visible intervals, one query tile at a
    time, so its memory does not grow with the square of the row.
    """
    if q_tile < 1 or k_tile < 1:
        raise ValueError(f"tile sizes must be positive, got q_tile={q_tile} k_tile={k_tile}")
    starts, ends = visible_intervals(grid, window)
    key_tiles = -(-(grid.seq_len + grid.num_queries) // k_tile)
    tile_start = np.arange(key_tiles) * k_tile
    nonempty = 0
    for first in range(0, grid.num_queries, q_tile):
        start, end = starts[first:first + q_tile, :, None], ends[first:first + q_tile, :, None]
        meets = (start < end) & (start < tile_start + k_tile) & (end > tile_start)  # [rows, 2, key tiles]
        nonempty += int(meets.any(axis=(0, 1)).sum())
    return nonempty / (-(-grid.num_queries // q_tile) * key_tiles)
