"""DFlash attention (design §5) in plain XLA: no score is computed that the mask would throw away wholesale.

A query of block j sees two disjoint key sets: context positions (p < a_j, within the window on sliding layers,
same document) and its own block's B slots. They are scored separately and joined in one softmax: each part
gives its scores' row maximum and exponentials, the joint maximum rescales both, and the output is
(Σ_ctx e·v + Σ_blk e·v) / (Σ_ctx e + Σ_blk e), i.e. softmax over [context | own block] exactly. The block part
is B×B per block (never the N·B×N·B block matrix, of which only the diagonal blocks are visible). The context
part walks query chunks of C blocks over the context range their anchors reach, known at trace time from the
static anchor grid: scores [batch, Hq, C*B, reach] in fp32 with reach = max a_j (full layers) or
max a_j - min a_j + W - 1 at most (sliding layers), instead of [batch, Hq, N*B, T + N*B] for the dense form.
Each chunk is rematerialised in the backward pass (`jax.checkpoint`): the backward keeps only the inputs, not
any chunk's probabilities (flash-attention's trade of compute for memory).

Layout: queries and keys are put head-major once per call ([b, Hkv, rows, group, D] and [b, Hkv, keys, D]),
so that every chunk's matmuls take their operands as stored, with the batch and kv-head axes leading, and no
chunk copies (transposes) its slice of the keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.attention import MASKED_SCORE, grouped_attention, to_head_major
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

    batch, _, q_heads, head_dim = q.shape
    kv_heads = k_ctx.shape[2]
    # Head-major once: q [b, Hkv, N*B, group, D] (the group's query heads next to their rows, so that a
    # matmul's rows are (row, group) and its batch axes (b, Hkv) lead); keys and values [b, Hkv, len, D].
    q = to_head_major(q, kv_heads)
    k_ctx, v_ctx, k_blk, v_blk = (x.swapaxes(1, 2) for x in (k_ctx, v_ctx, k_blk, v_blk))
    arrays = (q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, anchor_segment_ids)
    outputs = []
    for first_block in range(0, grid.num_anchors, query_chunk_blocks):
        end_block = min(first_block + query_chunk_blocks, grid.num_anchors)
        attend = functools.partial(_attend_chunk, grid, window, scale, first_block, end_block)
        outputs.append(jax.checkpoint(attend)(*arrays))
    out = jnp.concatenate(outputs, axis=2).swapaxes(1, 2)  # [b, N*B, Hkv, group, D]
    return out.reshape(batch, grid.num_queries, q_heads, head_dim).astype(q.dtype)


def _attend_chunk(grid: AnchorGrid, window: int | None, scale: float, first_block: int, end_block: int,
                  q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, anchor_segment_ids) -> jax.Array:
    """Attention of the queries of blocks first_block..end_block-1: [b, Hkv, C*B, group, D] in fp32.

    It takes the full (head-major) inputs and slices them itself, so that under `jax.checkpoint` the backward
    keeps the full inputs (shared by all chunks) as residuals, not one copy of each chunk's context slice.
    """
    block, blocks = grid.block_size, end_block - first_block
    rows = slice(first_block * block, end_block * block)
    q = q[:, :, rows]
    batch, kv_heads, _, group, head_dim = q.shape

    # Own blocks: [b, Hkv, C, B, group, B] scores of slot k (rows) against slot k' (keys) of the same block.
    by_block = (batch, kv_heads, blocks, block)
    block_scores = jnp.einsum("bhcqgd,bhckd->bhcqgk", q.reshape(*by_block, group, head_dim),
                              k_blk[:, :, rows].reshape(*by_block, head_dim), preferred_element_type=jnp.float32)
    block_scores = block_scores.reshape(batch, kv_heads, blocks * block, group, block) * scale
    if window is not None:  # sliding layers: causal within the block (k' <= k)
        slot = jnp.arange(block)
        causal = jnp.tile(slot[None, :] <= slot[:, None], (blocks, 1))  # [C*B, B]
        block_scores = jnp.where(causal[:, None, :], block_scores, MASKED_SCORE)
    row_max = jnp.max(block_scores, axis=-1)

    # Context: [b, Hkv, C*B, group, reach] over the positions the chunk's anchors reach.
    start, stop = context_reach(grid, window, first_block, end_block)
    if stop > start:
        query_anchor = jnp.asarray(grid.query_anchors[rows])[:, None]
        query_slot = jnp.asarray(grid.query_slots[rows])[:, None]
        query_segment = jnp.repeat(anchor_segment_ids[:, first_block:end_block], block, axis=1)
        visible = (context_rule(query_anchor, query_slot, jnp.arange(start, stop)[None, :], window)[None]
                   & (query_segment[:, :, None] == context_segment_ids[:, None, start:stop]))  # [b, C*B, reach]
        context_scores = jnp.einsum("bhqgd,bhkd->bhqgk", q, k_ctx[:, :, start:stop],
                                    preferred_element_type=jnp.float32) * scale
        context_scores = jnp.where(visible[:, None, :, None, :], context_scores, MASKED_SCORE)
        row_max = jnp.maximum(row_max, jnp.max(context_scores, axis=-1))

    # One softmax over both parts; every row sees at least its own slot, so the total is >= 1.
    block_weights = jnp.exp(block_scores - row_max[..., None])
    total = jnp.sum(block_weights, axis=-1)
    out = jnp.einsum("bhcqgk,bhckd->bhcqgd", block_weights.reshape(*by_block, group, block).astype(v_blk.dtype),
                     v_blk[:, :, rows].reshape(*by_block, head_dim), preferred_element_type=jnp.float32)
    out = out.reshape(batch, kv_heads, blocks * block, group, head_dim)
    if stop > start:
        context_weights = jnp.exp(context_scores - row_max[..., None])
        total = total + jnp.sum(context_weights, axis=-1)
        out = out + jnp.einsum("bhqgk,bhkd->bhqgd", context_weights.astype(v_ctx.dtype), v_ctx[:, :, start:stop],
                               preferred_element_type=jnp.float32)
    return out / total[..., None]


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
