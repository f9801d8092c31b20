"""DFlash attention (design §5) in plain XLA: no score is computed that the mask would throw away wholesale.

A query of block j sees two disjoint key sets: context positions (p < a_j, within the window on sliding layers,
same document) and its own block's B slots. They are scored separately and joined in one softmax: each part
gives its scores' row maximum and exponentials, the joint maximum rescales both, and the output is
(Σ_ctx e·v + Σ_blk e·v) / (Σ_ctx e + Σ_blk e), i.e. softmax over [context | own block] exactly. The block part
is B×B per block (never the N·B×N·B block matrix, of which only the diagonal blocks are visible).

The context part walks query chunks of C blocks, each scored against a fixed number of consecutive context
positions (its reach) that covers every position its static anchors can see: scores [batch, Hq, C*B, reach] in
fp32 instead of [batch, Hq, N*B, T + N*B] for the dense form. The chunks are a `lax.scan` (one body, so the
compiled program and its compile time do not grow with the number of chunks), grouped into runs of one reach
(`chunk_runs`): on a sliding layer every chunk whose window lies in the row sees the same width, (C-1)*S + W - 1
positions from its first anchor's window start, so one run covers them; before them (and on a full layer
throughout) the reach is the prefix before the chunk's last anchor, which grows along the row, so those chunks
fall into a few runs of equal count, each scanned over its last chunk's prefix. Each chunk is rematerialised in the backward pass (`jax.checkpoint`
of the scan's body): the backward keeps only the inputs, not any chunk's probabilities (flash-attention's trade
of compute for memory), and one chunk's scores are alive at a time.

Layout: queries and keys are put head-major once per call ([b, Hkv, rows, group, D] and [b, Hkv, keys, D]), so
that every chunk's matmuls take their operands as stored, with the batch and kv-head axes leading; the scan
takes the queries and block keys chunk by chunk and slices each chunk's context reach out of the whole row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.attention import MASKED_SCORE, grouped_attention, to_head_major
from dflash_jax.ops.mask import block_rule, context_rule, validate_window

# The chunks whose reach is a prefix of the row (every chunk of a full layer; on a sliding layer those whose window
# the row's start cuts short) fall into runs of equal count, each scored against the prefix its last chunk reaches:
# with k runs a full layer scores (k + 1) / k of the positions the growing prefixes need. k is the smallest that
# keeps the layer's scored positions within PREFIX_WASTE of what each chunk's own reach holds, at most PREFIX_RUNS
# (one scan body each).
PREFIX_RUNS = 4
PREFIX_WASTE = 1.25


def context_reach(grid: AnchorGrid, window: int | None, first_block: int, end_block: int) -> tuple[int, int]:
    """[start, stop) of the context positions blocks first_block..end_block-1 can see (position part only).

    Full layers: p < max a_j. Sliding layers: also p > a_j + k - W, so the first visible p is
    min a_j - W + 1 (slot 0 of the first block). May be empty (start == stop), e.g. for the block at anchor 0.
    """
    anchors = grid.anchors[first_block:end_block]
    stop = int(anchors.max())
    start = 0 if window is None else max(0, int(anchors.min()) - window + 1)
    return start, stop


@dataclasses.dataclass(frozen=True)
class ChunkRun:
    """`chunks` consecutive query chunks of `blocks` blocks each, from block `first_block`, computed by one scan
    body: each chunk scores its queries against `reach` consecutive context positions, from 0 (a prefix run) or
    from its first anchor's window start (`windowed`; `reach_start`)."""

    first_block: int
    chunks: int
    blocks: int
    reach: int
    windowed: bool

    @property
    def end_block(self) -> int:
        return self.first_block + self.chunks * self.blocks


def chunk_runs(grid: AnchorGrid, window: int | None, query_chunk_blocks: int) -> list[ChunkRun]:
    """The runs covering the N blocks in chunks of query_chunk_blocks (a shorter last chunk is a run of its own).

    A chunk whose window starts inside the row (sliding layers, past the first W positions) sees (C-1)*S + W - 1
    positions from its first anchor's window start, as every such chunk does: one windowed run. The chunks
    before them, and every chunk of a full layer, see the prefix before their last anchor: prefix runs of equal
    count (PREFIX_RUNS, PREFIX_WASTE), each of its last chunk's reach.
    """
    full_chunks, rest = divmod(grid.num_anchors, query_chunk_blocks)
    spans = [context_reach(grid, window, c * query_chunk_blocks, (c + 1) * query_chunk_blocks)
             for c in range(full_chunks)]
    prefix = sum(start == 0 for start, _ in spans)  # chunk c's start grows with c
    windowed = []
    if prefix < full_chunks:
        width = min(grid.seq_len, (query_chunk_blocks - 1) * grid.stride + window - 1)
        windowed = [ChunkRun(prefix * query_chunk_blocks, full_chunks - prefix, query_chunk_blocks, width, True)]
    needed = sum(stop - start for start, stop in spans)
    runs = windowed
    for parts in range(1, min(PREFIX_RUNS, prefix) + 1):
        bounds = [round(i * prefix / parts) for i in range(parts + 1)]
        runs = [ChunkRun(low * query_chunk_blocks, high - low, query_chunk_blocks, spans[high - 1][1], False)
                for low, high in zip(bounds, bounds[1:])] + windowed
        if sum(run.chunks * run.reach for run in runs) <= PREFIX_WASTE * needed:
            break
    if rest:
        first = full_chunks * query_chunk_blocks
        if window is None:
            runs.append(ChunkRun(first, 1, rest, int(grid.anchors[-1]), False))
        else:
            runs.append(ChunkRun(first, 1, rest, min(grid.seq_len, (rest - 1) * grid.stride + window - 1), True))
    return runs


def reach_start(grid: AnchorGrid, window: int | None, run: ChunkRun, first_anchor):
    """The first context position a chunk of `run` whose first anchor is first_anchor (an int or a traced
    scalar) scores: 0 for a prefix run; for a windowed one that anchor's window start a - W + 1, moved into the
    row so that the reach fits (a shifted window still holds every position the chunk sees: `context_reach`)."""
    if not run.windowed:
        return 0
    return jnp.clip(first_anchor - window + 1, 0, grid.seq_len - run.reach)


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
    outputs = [_attend_run(grid, window, scale, run, q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids,
                           anchor_segment_ids)
               for run in chunk_runs(grid, window, query_chunk_blocks)]
    out = jnp.concatenate(outputs, axis=2).swapaxes(1, 2)  # [b, N*B, Hkv, group, D]
    return out.reshape(batch, grid.num_queries, q_heads, head_dim)


def _attend_run(grid: AnchorGrid, window: int | None, scale: float, run: ChunkRun, q, k_ctx, v_ctx, k_blk, v_blk,
                context_segment_ids, anchor_segment_ids) -> jax.Array:
    """The queries of one run's blocks, [b, Hkv, chunks*blocks*B, group, D] in q.dtype: a scan over its chunks.

    The queries, block keys/values and anchor segments go in chunk by chunk (a leading chunk axis); the context
    and its segments are the scan's constants, each chunk slicing its reach out of them, so the backward keeps
    the whole context once (not a copy per chunk) and accumulates its gradient in place.
    """
    def by_chunk(x: jax.Array, axis: int, start: int, stop: int) -> jax.Array:
        """x[..., start:stop, ...] along axis, split into the run's chunks along a new leading axis."""
        x = jax.lax.slice_in_dim(x, start, stop, axis=axis)
        return jnp.moveaxis(x.reshape(*x.shape[:axis], run.chunks, -1, *x.shape[axis + 1:]), axis, 0)

    rows = (run.first_block * grid.block_size, run.end_block * grid.block_size)
    # Each query row's anchor, a constant per chunk: the mask's comparisons then read it, where computing it
    # from a traced chunk index would repeat integer divisions in every fusion over the scores.
    query_anchors = jnp.asarray(grid.query_anchors[rows[0]:rows[1]].reshape(run.chunks, -1))
    chunks = (query_anchors, by_chunk(q, 2, *rows), by_chunk(k_blk, 2, *rows), by_chunk(v_blk, 2, *rows),
              by_chunk(anchor_segment_ids, 1, run.first_block, run.end_block))
    attend = jax.checkpoint(functools.partial(_attend_chunk, grid, window, scale, run), prevent_cse=False)
    _, out = jax.lax.scan(lambda carry, chunk: (carry, attend(k_ctx, v_ctx, context_segment_ids, *chunk)), None,
                          chunks)
    out = jnp.moveaxis(out, 0, 2)  # [b, Hkv, chunks, blocks*B, group, D]
    return out.reshape(*out.shape[:2], -1, *out.shape[4:])


def _attend_chunk(grid: AnchorGrid, window: int | None, scale: float, run: ChunkRun, k_ctx, v_ctx,
                  context_segment_ids, query_anchors, q, k_blk, v_blk, anchor_segment_ids) -> jax.Array:
    """Attention of one chunk's queries, run.blocks blocks: query_anchors [C*B] (each row's anchor), q [b, Hkv,
    C*B, group, D], k_blk/v_blk [b, Hkv, C*B, D], anchor_segment_ids [b, C]; returns [b, Hkv, C*B, group, D] in
    q.dtype."""
    block, blocks = grid.block_size, run.blocks
    batch, kv_heads, _, group, head_dim = q.shape

    # Own blocks: [b, Hkv, C, B, group, B] scores of slot k (rows) against slot k' (keys) of the same block.
    by_block = (batch, kv_heads, blocks, block)
    block_scores = jnp.einsum("bhcqgd,bhckd->bhcqgk", q.reshape(*by_block, group, head_dim),
                              k_blk.reshape(*by_block, head_dim), preferred_element_type=jnp.float32)
    block_scores = block_scores.reshape(batch, kv_heads, blocks * block, group, block) * scale
    if window is not None:  # sliding layers: causal within the block (k' <= k)
        slot = jnp.arange(block)
        causal = jnp.tile(slot[None, :] <= slot[:, None], (blocks, 1))  # [C*B, B]
        block_scores = jnp.where(causal[:, None, :], block_scores, MASKED_SCORE)
    row_max = jnp.max(block_scores, axis=-1)

    # Context: [b, Hkv, C*B, group, reach] over the run's reach from this chunk's start.
    if run.reach:
        start = reach_start(grid, window, run, query_anchors[0])
        query_slot = np.tile(np.arange(block), blocks)[:, None]
        keys = start + jnp.arange(run.reach)
        query_segment = jnp.repeat(anchor_segment_ids, block, axis=1)
        key_segment = jax.lax.dynamic_slice_in_dim(context_segment_ids, start, run.reach, axis=1)
        visible = (context_rule(query_anchors[:, None], query_slot, keys[None, :], window)[None]
                   & (query_segment[:, :, None] == key_segment[:, None, :]))  # [b, C*B, reach]
        k_reach, v_reach = (jax.lax.dynamic_slice_in_dim(x, start, run.reach, axis=2) for x in (k_ctx, v_ctx))
        context_scores = jnp.einsum("bhqgd,bhkd->bhqgk", q, k_reach, preferred_element_type=jnp.float32) * scale
        context_scores = jnp.where(visible[:, None, :, None, :], context_scores, MASKED_SCORE)
        row_max = jnp.maximum(row_max, jnp.max(context_scores, axis=-1))

    # One softmax over both parts; every row sees at least its own slot, so the total is >= 1.
    block_weights = jnp.exp(block_scores - row_max[..., None])
    total = jnp.sum(block_weights, axis=-1)
    out = jnp.einsum("bhcqgk,bhckd->bhcqgd", block_weights.reshape(*by_block, group, block).astype(v_blk.dtype),
                     v_blk.reshape(*by_block, head_dim), preferred_element_type=jnp.float32)
    out = out.reshape(batch, kv_heads, blocks * block, group, head_dim)
    if run.reach:
        context_weights = jnp.exp(context_scores - row_max[..., None])
        total = total + jnp.sum(context_weights, axis=-1)
        out = out + jnp.einsum("bhqgk,bhkd->bhqgd", context_weights.astype(v_reach.dtype), v_reach,
                               preferred_element_type=jnp.float32)
    return (out / total[..., None]).astype(q.dtype)


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
