"""DFlash attention (design §5) in plain XLA, walking query chunks so the full score matrix never exists.

Because the anchor grid is static, the keys a chunk of blocks can see are known at trace time: the context
range its anchors reach plus its own blocks. Everything outside that range is masked for every query of the
chunk, so it is neither computed nor stored. Memory per chunk of C blocks:
scores [batch, Hq, C*B, reach + C*B] in fp32, with reach = max a_j (full layers) or
max a_j - min a_j + W - 1 at most (sliding layers), instead of [batch, Hq, N*B, T + N*B] for the dense form.
Each chunk is rematerialised in the backward pass (`jax.checkpoint`): the backward keeps only the inputs,
not any chunk's probabilities, and recomputes them chunk by chunk (flash-attention's trade of compute for
memory).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops.attention import grouped_attention
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.mask import block_rule, context_rule, validate_window


def context_reach(grid: AnchorGrid, window: int | None, first_block: int, end_block: int) -> tuple[int, int]:
    """[start, stop) of the context positions blocks first_block..end_block-1 can see (position part only).

    Full layers: p < max a_j. Sliding layers: also p > a_j + k - W, so the first visible p is
    min a_j - W + 1 (slot 0 of the first block). May be empty (start == stop), e.g. for the block at anchor 0.
    """
    anchors = grid.anchors[first_block:end_block]
    stop = int(anchors.max())
    start = 0 if window is None else max(0, int(anchors.min()) - window + 1)
    return start, stop


def dflash_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    context_segment_ids: jax.Array,
    anchor_segment_ids: jax.Array,
    grid: AnchorGrid,
    window: int | None,
    scale: float,
    *,
    query_chunk_blocks: int,
) -> jax.Array:
    """Block queries attend to [context | blocks] under the design §5 mask; returns [b, N*B, Hq, D] in q.dtype.

    q: [b, N*B, Hq, D]; k_ctx, v_ctx: [b, T, Hkv, D]; k_blk, v_blk: [b, N*B, Hkv, D];
    context_segment_ids: [b, T]; anchor_segment_ids: [b, N] (the segment of each anchor position);
    window: None for a full-attention layer, W for a sliding-window layer; query_chunk_blocks: blocks per
    chunk (the last chunk may be shorter). Scores and softmax in fp32, GQA as in `grouped_attention`.
    """
    batch = q.shape[0]
    expected = {
        "q": (q, (batch, grid.num_queries)), "k_ctx": (k_ctx, (batch, grid.seq_len)),
        "v_ctx": (v_ctx, (batch, grid.seq_len)), "k_blk": (k_blk, (batch, grid.num_queries)),
        "v_blk": (v_blk, (batch, grid.num_queries)),
        "context_segment_ids": (context_segment_ids, (batch, grid.seq_len)),
        "anchor_segment_ids": (anchor_segment_ids, (batch, grid.num_anchors)),
    }
    for name, (array, leading) in expected.items():
        if tuple(array.shape[:2]) != leading:
            raise ValueError(f"dflash_attention: {name} has shape {tuple(array.shape)}, expected leading "
                             f"dimensions {leading} for {grid}")
    if query_chunk_blocks < 1:
        raise ValueError(f"query_chunk_blocks must be >= 1, got {query_chunk_blocks}")
    validate_window(window)

    arrays = (q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, anchor_segment_ids)
    outputs = []
    for first_block in range(0, grid.num_anchors, query_chunk_blocks):
        end_block = min(first_block + query_chunk_blocks, grid.num_anchors)
        attend = functools.partial(_attend_chunk, grid, window, scale, first_block, end_block)
        outputs.append(jax.checkpoint(attend)(*arrays))
    return jnp.concatenate(outputs, axis=1).astype(q.dtype)


def _attend_chunk(grid: AnchorGrid, window: int | None, scale: float, first_block: int, end_block: int,
                  q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, anchor_segment_ids) -> jax.Array:
    """Attention of the queries of blocks first_block..end_block-1 over their reachable keys only.

    It takes the full inputs and slices them itself, so that under `jax.checkpoint` the backward keeps the
    full inputs (shared by all chunks) as residuals, not one copy of each chunk's context slice.
    """
    start, stop = context_reach(grid, window, first_block, end_block)
    rows = slice(first_block * grid.block_size, end_block * grid.block_size)
    query_index = jnp.arange(rows.start, rows.stop)[:, None]
    query_anchor = jnp.asarray(grid.query_anchors[rows])[:, None]
    query_slot = jnp.asarray(grid.query_slots[rows])[:, None]
    query_segment = jnp.repeat(anchor_segment_ids[:, first_block:end_block], grid.block_size, axis=1)

    context_visible = (context_rule(query_anchor, query_slot, jnp.arange(start, stop)[None, :], window)[None]
                       & (query_segment[:, :, None] == context_segment_ids[:, None, start:stop]))
    own_blocks_visible = block_rule(query_index, query_index.T, grid.block_size, causal=window is not None)
    visible = jnp.concatenate(
        [context_visible, jnp.broadcast_to(own_blocks_visible, (q.shape[0],) + own_blocks_visible.shape)], axis=2)
    keys = jnp.concatenate([k_ctx[:, start:stop], k_blk[:, rows]], axis=1)
    values = jnp.concatenate([v_ctx[:, start:stop], v_blk[:, rows]], axis=1)
    return grouped_attention(q[:, rows], keys, values, visible, scale)


def cached_dflash_attention(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, k_blk: jax.Array, v_blk: jax.Array,
                            window: int | None, scale: float, *, anchor: jax.Array) -> jax.Array:
    """The §5 mask for one block per row at a (traced) anchor position, over a decoding cache whose column is
    the position: q, k_blk, v_blk [b, B, H*, D]; k_ctx, v_ctx [b, capacity, Hkv, D]. Context column p is
    visible from slot k iff p < anchor (and p > anchor + k - W on a sliding layer), by `context_rule`;
    columns at or past the anchor (stale rows of a rejected block) never are. One document per row."""
    slots = np.arange(q.shape[1])
    columns = jnp.arange(k_ctx.shape[1])
    context = jnp.broadcast_to(context_rule(anchor, slots[:, None], columns[None, :], window),
                               (slots.size, columns.size))
    own_block = jnp.asarray(block_rule(slots[:, None], slots[None, :], slots.size, causal=window is not None))
    visible = jnp.concatenate([context, own_block], axis=1)
    keys = jnp.concatenate([k_ctx, k_blk.astype(k_ctx.dtype)], axis=1)
    values = jnp.concatenate([v_ctx, v_blk.astype(v_ctx.dtype)], axis=1)
    out = grouped_attention(q, keys, values, jnp.broadcast_to(visible, (q.shape[0], *visible.shape)), scale)
    return out.astype(q.dtype)
