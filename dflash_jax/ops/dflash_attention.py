"""DFlash attention (design §5) in plain XLA: no score is computed that the mask would throw away wholesale.

A query of block j sees two disjoint key sets: context positions (p < a_j, within the window on sliding layers,
same document) and its own block's B slots. Their scores join in one softmax, computed flash-attention style:
each row's running maximum m, exponential sum l and weighted values acc start from its own block's B×B scores
(never the N·B×N·B block matrix, of which only the diagonal blocks are visible) and take in the context one key
tile at a time; the output is acc / l.

The context part pairs query chunks of C blocks with key tiles of a fixed width (`tile_schedule`): a chunk's
tiles cover the positions its static anchors can see (`context_reach`), scoring less than one tile beyond them.
The pairs are a flat, statically known list and one `lax.scan` visits them all, so the compiled program is the
same whatever the chunk count (and so is its compile time) and one pair's scores are alive at a time. The
backward is flash attention's (a `jax.custom_vjp`): from the output and each row's log-sum-exp it rescores each
pair, so nothing of the forward's per-pair work is kept.

Layout: queries and keys are put head-major once per call ([b, Hkv, rows, group, D] and [b, Hkv, keys, D]), so
that every pair's matmuls take their operands as stored, with the batch and kv-head axes leading; each pair
slices its chunk's rows and its tile's keys out of the whole arrays at offsets the schedule gives.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.attention import MASKED_SCORE, grouped_attention, to_head_major
from dflash_jax.ops.context_parallel import on_row_shards, with_halo
from dflash_jax.ops.mask import block_rule, context_rule, validate_window
from dflash_jax.sharding import CONTEXT_AXIS, constrain, context_shards

# Widest context key tile. A layer's tiles are as wide as its widest chunk reach split into the fewest tiles of
# at most KEY_TILE: a sliding layer's windowed chunks then fill their tiles exactly, and any chunk scores less
# than one tile beyond its reach. Narrower tiles waste less and loop more (each pair is a trip of the scan).
KEY_TILE = 512


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
class TileSchedule:
    """The (query chunk, key tile) pairs of one layer, in chunk order: pair i scores the query rows
    [row_start[i], row_start[i] + chunk_rows) against the context positions [key_start[i], key_start[i] + width),
    of which it counts only rows >= row_low[i] and positions >= key_low[i]. The lows are where the chunk and the
    tile begin; a start lies below its low only where the last chunk or tile was moved back to fit in the row, so
    that no row or position is counted twice."""

    chunk_rows: int
    width: int
    row_start: np.ndarray
    row_low: np.ndarray
    key_start: np.ndarray
    key_low: np.ndarray

    @property
    def pairs(self) -> int:
        return len(self.row_start)

    def as_array(self) -> jax.Array:
        """[pairs, 4] int32: the scan's per-pair offsets."""
        return jnp.asarray(np.stack([self.row_start, self.row_low, self.key_start, self.key_low], axis=1),
                           dtype=jnp.int32)


@functools.lru_cache(maxsize=64)
def tile_schedule(grid: AnchorGrid, window: int | None, query_chunk_blocks: int,
                  key_tile: int = KEY_TILE, first_block: int = 0) -> TileSchedule:
    """The pairs covering each chunk's context reach (the last chunk may be shorter: it is moved back to end at
    the last row). A chunk with nothing to see (the block at anchor 0) has no pair. first_block: the queries are
    those of blocks first_block.. only (a shard's own blocks in its frame, `_attention_over_context`); rows count
    from there."""
    blocks = min(query_chunk_blocks, grid.num_anchors - first_block)
    chunk_rows = blocks * grid.block_size
    queries = (grid.num_anchors - first_block) * grid.block_size
    firsts = range(first_block, grid.num_anchors, blocks)
    reaches = [context_reach(grid, window, first, min(first + blocks, grid.num_anchors)) for first in firsts]
    widest = max(stop - start for start, stop in reaches)
    width = math.ceil(widest / math.ceil(widest / key_tile)) if widest else 0  # the fewest tiles for the widest
    pairs = []
    for first, (start, stop) in zip(firsts, reaches):
        row_low = (first - first_block) * grid.block_size
        row_start = min(row_low, queries - chunk_rows)
        for key_low in range(start, stop, max(width, 1)):
            pairs.append((row_start, row_low, min(key_low, grid.seq_len - width), key_low))
    columns = np.asarray(pairs, dtype=np.int32).reshape(-1, 4).T
    return TileSchedule(chunk_rows, width, *columns)


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
    key_tile: int = KEY_TILE,
) -> jax.Array:
    """Block queries attend to [context | blocks] under the design §5 mask; returns [b, N*B, Hq, D] in q.dtype.

    q: [b, N*B, Hq, D]; k_ctx, v_ctx: [b, T, Hkv, D]; k_blk, v_blk: [b, N*B, Hkv, D];
    context_segment_ids: [b, T]; anchor_segment_ids: [b, N] (the segment of each anchor position);
    window: None for a full-attention layer, W for a sliding-window layer; query_chunk_blocks: blocks per
    query chunk (the last chunk may be shorter); key_tile: the widest context key tile. Scores and softmax in
    fp32, GQA as in `grouped_attention`.
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
    if query_chunk_blocks < 1 or key_tile < 1:
        raise ValueError(f"query_chunk_blocks and key_tile must be >= 1, got {query_chunk_blocks} and {key_tile}")
    validate_window(window)

    shards = context_shards()
    if shards > 1 and grid.num_anchors % shards == 0:  # each shard holds its own anchors' blocks (design §19)
        return _attention_over_context(q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, anchor_segment_ids,
                                       grid, window, float(scale), query_chunk_blocks, key_tile, shards)
    batch, _, q_heads, head_dim = q.shape
    kv_heads = k_ctx.shape[2]
    layer = _Layer(grid, window, float(scale), query_chunk_blocks, key_tile)
    # Head-major once: q [b, Hkv, N*B, group, D] (the group's query heads next to their rows, so that a
    # matmul's rows are (row, group) and its batch axes (b, Hkv) lead); keys and values [b, Hkv, len, D].
    operands = [to_head_major(q, kv_heads), *(x.swapaxes(1, 2) for x in (k_ctx, v_ctx, k_blk, v_blk)),
                context_segment_ids, jnp.repeat(anchor_segment_ids, grid.block_size, axis=1)]
    out = _whole_rows(_attention(layer, *map(_whole_rows, operands)))
    return out.swapaxes(1, 2).reshape(batch, grid.num_queries, q_heads, head_dim)


def _attention_over_context(q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, anchor_segment_ids, grid: AnchorGrid,
                            window: int | None, scale: float, query_chunk_blocks: int, key_tile: int,
                            shards: int) -> jax.Array:
    """`dflash_attention` of rows split over the context axis (design §19): each shard attends for the blocks of
    its own anchors (anchors lie every S tokens, so shard i of L = T/N tokens holds blocks [i·L/S, (i+1)·L/S)).
    Its keys are its own context positions and the `halo` before them that its blocks can see: on a sliding layer
    the last ⌈(W − 1)/S⌉·S positions of the shards before it (collective permutes), on the full layer the whole
    prefix (one all-gather). In that frame, which starts `halo` positions before the shard, the shard's anchors
    are halo + j·S whatever the shard: one static grid of halo + L positions whose queries start at block
    halo / S serves every shard, and its schedule is the unsplit attention's. Positions before the row's start
    carry the segment BEFORE_THE_ROW, which no query has."""
    length = grid.seq_len // shards
    halo = halo_positions(window, grid.stride, (shards - 1) * length)
    layer = _Layer(AnchorGrid(halo + length, grid.stride, grid.block_size), window, scale, query_chunk_blocks,
                   key_tile, first_block=halo // grid.stride, split=True)

    def local(q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, anchor_segment_ids):
        batch, rows, q_heads, head_dim = q.shape
        k_ctx, v_ctx = (with_halo(x, halo, CONTEXT_AXIS, 0) for x in (k_ctx, v_ctx))
        context_segment_ids = with_halo(context_segment_ids, halo, CONTEXT_AXIS, BEFORE_THE_ROW)
        operands = [to_head_major(q, k_ctx.shape[2]), *(x.swapaxes(1, 2) for x in (k_ctx, v_ctx, k_blk, v_blk)),
                    context_segment_ids, jnp.repeat(anchor_segment_ids, grid.block_size, axis=1)]
        out = _attention(layer, *operands)
        return out.swapaxes(1, 2).reshape(batch, rows, q_heads, head_dim)

    return on_row_shards(local, q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, anchor_segment_ids)


def halo_positions(window: int | None, stride: int, prefix: int) -> int:
    """How many context positions before a shard its blocks can see, in whole strides (anchors stay on the
    grid): ⌈(W − 1)/S⌉·S on a sliding layer (slot 0 of an anchor a sees from a − W + 1), at most the `prefix`
    before the shard; the full layer the whole prefix."""
    return prefix if window is None else min(math.ceil((window - 1) / stride) * stride, prefix)


# The segment id of a split row's frame positions before the row's start (`_attention_over_context`): no token's.
BEFORE_THE_ROW = np.iinfo(np.int32).min


def _whole_rows(x: jax.Array) -> jax.Array:
    """x [b, (Hkv,) len, ...] with its length whole on every device of the mesh's context axis; unchanged when
    rows are not split over it. On split rows (design §19) the scan of `_attention` takes its chunks and tiles at
    static offsets of the whole row, so it runs on the whole row's operands, gathered once a layer rather than
    piece by piece in each step of the scan: every context device attends for all of its rows' queries."""
    if context_shards() == 1:
        return x
    heads = () if x.ndim == 2 else ("activation_kv_heads",)
    return constrain(x, ("activation_batch", *heads, None, *([None] * (x.ndim - len(heads) - 2))))


@dataclasses.dataclass(frozen=True)
class _Layer:
    """What the attention holds static: the grid, the layer's window and scale, and how it tiles the context;
    the queries are those of blocks first_block.. of the grid; split: run on one shard of a row
    (`_attention_over_context`), where nothing is gathered whole."""

    grid: AnchorGrid
    window: int | None
    scale: float
    query_chunk_blocks: int
    key_tile: int
    first_block: int = 0
    split: bool = False

    @property
    def schedule(self) -> TileSchedule:
        return tile_schedule(self.grid, self.window, self.query_chunk_blocks, self.key_tile, self.first_block)

    @property
    def num_blocks(self) -> int:
        return self.grid.num_anchors - self.first_block

    def query_table(self, table: np.ndarray) -> np.ndarray:
        """A per-query table of the grid (anchor, slot), from the first held block's rows."""
        return table[self.first_block * self.grid.block_size:]


# The operands from here on are head-major: q [b, Hkv, N*B, group, D]; k_ctx, v_ctx [b, Hkv, T, D]; k_blk, v_blk
# [b, Hkv, N*B, D]; context_segment_ids [b, T]; query_segment_ids [b, N*B] (each row's anchor's segment).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(layer: _Layer, q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, query_segment_ids):
    return _forward(layer, q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, query_segment_ids)[0]


def _forward(layer: _Layer, q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, query_segment_ids):
    """The output [b, Hkv, N*B, group, D] in q.dtype and each row's log-sum-exp [b, Hkv, N*B, group] (fp32)."""
    grid, schedule = layer.grid, layer.schedule
    by_block = (*q.shape[:2], layer.num_blocks, grid.block_size)
    scores = _block_scores(layer, q, k_blk)
    row_max = jnp.max(scores, axis=-1)
    weights = jnp.exp(scores - row_max[..., None])
    values = jnp.einsum("bhnqgk,bhnkd->bhnqgd", weights.astype(v_blk.dtype), v_blk.reshape(*by_block, -1),
                        preferred_element_type=jnp.float32)
    # Every row sees its own slot, so its maximum is a real score from here on and a masked one weighs exp(-1e30).
    state = tuple(x.reshape(*q.shape[:3], *x.shape[4:]) for x in (row_max, jnp.sum(weights, axis=-1), values))

    def take_tile(state, pair):
        scores, _ = _pair_scores(layer, q, k_ctx, context_segment_ids, query_segment_ids, pair)
        v_tile = jax.lax.dynamic_slice_in_dim(v_ctx, pair[2], schedule.width, axis=2)
        row_max, total, values = (jax.lax.dynamic_slice_in_dim(x, pair[0], schedule.chunk_rows, axis=2)
                                  for x in state)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
        weights = jnp.exp(scores - new_max[..., None])
        rescale = jnp.exp(row_max - new_max)
        total = rescale * total + jnp.sum(weights, axis=-1)
        values = rescale[..., None] * values + jnp.einsum("bhqgk,bhkd->bhqgd", weights.astype(v_tile.dtype), v_tile,
                                                          preferred_element_type=jnp.float32)
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, new, pair[0], axis=2)
                     for x, new in zip(state, (new_max, total, values))), None

    if schedule.pairs:
        state, _ = jax.lax.scan(take_tile, state, schedule.as_array())
    row_max, total, values = state
    return (values / total[..., None]).astype(q.dtype), row_max + jnp.log(total)


def _attention_forward(layer: _Layer, *inputs):
    out, log_sum_exp = _forward(layer, *inputs)
    return out, (*inputs, out, log_sum_exp)


def _attention_backward(layer: _Layer, residuals, d_out):
    """Flash attention's backward: with P a pair's (or block's) probabilities rescored from the row's
    log-sum-exp and D = Σ_d dO·O per row, dV = Pᵀ·dO, dS = P ⊙ (dO·Vᵀ − D), dQ = dS·K, dK = dSᵀ·Q (times the
    scale), products in the operands' dtype with fp32 accumulation."""
    q, k_ctx, v_ctx, k_blk, v_blk, context_segment_ids, query_segment_ids, out, log_sum_exp = residuals
    grid, schedule, scale = layer.grid, layer.schedule, layer.scale
    d_out = d_out if layer.split else _whole_rows(d_out)
    by_block = (*q.shape[:2], layer.num_blocks, grid.block_size)
    d_row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def d_scores(probs, d_out, values, d_row):
        d_probs = jnp.einsum("...qgd,...kd->...qgk", d_out, values, preferred_element_type=jnp.float32)
        return (probs * (d_probs - d_row[..., None]) * scale).astype(q.dtype)

    probs = jnp.exp(_block_scores(layer, q, k_blk) - log_sum_exp.reshape(*by_block, -1)[..., None])
    d_out_by_block, q_by_block = d_out.reshape(*by_block, *d_out.shape[3:]), q.reshape(*by_block, *q.shape[3:])
    d_v_blk = jnp.einsum("bhnqgk,bhnqgd->bhnkd", probs.astype(d_out.dtype), d_out_by_block,
                         preferred_element_type=jnp.float32)
    d_block = d_scores(probs, d_out_by_block, v_blk.reshape(*by_block, -1), d_row.reshape(*by_block, -1))
    d_q = jnp.einsum("bhnqgk,bhnkd->bhnqgd", d_block, k_blk.reshape(*by_block, -1),
                     preferred_element_type=jnp.float32).reshape(q.shape)
    d_k_blk = jnp.einsum("bhnqgk,bhnqgd->bhnkd", d_block, q_by_block, preferred_element_type=jnp.float32)

    def add_at(x, update, start):
        piece = jax.lax.dynamic_slice_in_dim(x, start, update.shape[2], axis=2)
        return jax.lax.dynamic_update_slice_in_dim(x, piece + update, start, axis=2)

    def give_back(grads, pair):
        d_q, d_k_ctx, d_v_ctx = grads
        scores, q_chunk = _pair_scores(layer, q, k_ctx, context_segment_ids, query_segment_ids, pair)
        k_tile, v_tile = (jax.lax.dynamic_slice_in_dim(x, pair[2], schedule.width, axis=2) for x in (k_ctx, v_ctx))
        d_out_chunk, log_sum_exp_chunk, d_row_chunk = (
            jax.lax.dynamic_slice_in_dim(x, pair[0], schedule.chunk_rows, axis=2)
            for x in (d_out, log_sum_exp, d_row))
        probs = jnp.exp(scores - log_sum_exp_chunk[..., None])
        d_pair = d_scores(probs, d_out_chunk, v_tile, d_row_chunk)
        d_v_tile = jnp.einsum("bhqgk,bhqgd->bhkd", probs.astype(d_out.dtype), d_out_chunk,
                              preferred_element_type=jnp.float32)
        d_k_tile = jnp.einsum("bhqgk,bhqgd->bhkd", d_pair, q_chunk, preferred_element_type=jnp.float32)
        d_q_chunk = jnp.einsum("bhqgk,bhkd->bhqgd", d_pair, k_tile, preferred_element_type=jnp.float32)
        return (add_at(d_q, d_q_chunk, pair[0]), add_at(d_k_ctx, d_k_tile, pair[2]),
                add_at(d_v_ctx, d_v_tile, pair[2])), None

    d_k_ctx, d_v_ctx = (jnp.zeros_like(x, jnp.float32) for x in (k_ctx, v_ctx))
    if schedule.pairs:
        (d_q, d_k_ctx, d_v_ctx), _ = jax.lax.scan(give_back, (d_q, d_k_ctx, d_v_ctx), schedule.as_array())
    grads = (d_q, d_k_ctx, d_v_ctx, d_k_blk.reshape(k_blk.shape), d_v_blk.reshape(v_blk.shape))
    return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k_ctx, v_ctx, k_blk, v_blk))), None, None)


_attention.defvjp(_attention_forward, _attention_backward)


def _block_scores(layer: _Layer, q, k_blk) -> jax.Array:
    """[b, Hkv, N, B, group, B] fp32: each row's scores against its own block's slots (k' <= k on sliding
    layers)."""
    grid = layer.grid
    by_block = (*q.shape[:2], layer.num_blocks, grid.block_size)
    scores = jnp.einsum("bhnqgd,bhnkd->bhnqgk", q.reshape(*by_block, *q.shape[3:]), k_blk.reshape(*by_block, -1),
                        preferred_element_type=jnp.float32) * layer.scale
    if layer.window is None:
        return scores
    slot = np.arange(grid.block_size)
    causal = block_rule(slot[:, None], slot[None, :], grid.block_size, causal=True)  # [B, B]
    return jnp.where(causal[:, None, :], scores, MASKED_SCORE)


def _pair_scores(layer: _Layer, q, k_ctx, context_segment_ids, query_segment_ids, pair) -> tuple[jax.Array, jax.Array]:
    """One pair's masked context scores [b, Hkv, rows, group, width] (fp32) and its chunk's queries."""
    grid, window, schedule = layer.grid, layer.window, layer.schedule
    row_start, row_low, key_start, key_low = (pair[i] for i in range(4))
    q_chunk = jax.lax.dynamic_slice_in_dim(q, row_start, schedule.chunk_rows, axis=2)
    k_tile = jax.lax.dynamic_slice_in_dim(k_ctx, key_start, schedule.width, axis=2)
    scores = jnp.einsum("bhqgd,bhkd->bhqgk", q_chunk, k_tile, preferred_element_type=jnp.float32) * layer.scale
    # Each row's anchor and slot read from constant tables: computing them from the row index would repeat
    # integer divisions in every fusion over the scores.
    anchors, slots = (jax.lax.dynamic_slice_in_dim(jnp.asarray(layer.query_table(table)), row_start,
                                                   schedule.chunk_rows)
                      for table in (grid.query_anchors, grid.query_slots))
    rows = row_start + jnp.arange(schedule.chunk_rows)
    keys = key_start + jnp.arange(schedule.width)
    visible = (context_rule(anchors[:, None], slots[:, None], keys[None, :], window)
               & (rows >= row_low)[:, None] & (keys >= key_low)[None, :])
    query_segment = jax.lax.dynamic_slice_in_dim(query_segment_ids, row_start, schedule.chunk_rows, axis=1)
    key_segment = jax.lax.dynamic_slice_in_dim(context_segment_ids, key_start, schedule.width, axis=1)
    visible = visible[None] & (query_segment[:, :, None] == key_segment[:, None, :])  # [b, rows, width]
    return jnp.where(visible[:, None, :, None, :], scores, MASKED_SCORE), q_chunk


def cached_dflash_attention(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, k_blk: jax.Array, v_blk: jax.Array,
                            window: int | None, scale: float, *, anchor: jax.Array,
                            key_positions: jax.Array | None = None) -> jax.Array:
    """The §5 mask for one block per row at a (traced) anchor position, over a decoding cache: q, k_blk, v_blk
    [b, B, H*, D]; k_ctx, v_ctx [b, columns, Hkv, D], column c holding position key_positions[c] (default c; a
    sliding layer's ring, models/drafter_cache.py; negative: nothing). Context position p is visible from slot
    k iff p < anchor (and p > anchor + k - W on a sliding layer), by `context_rule`; columns at or past the
    anchor (stale rows of a rejected block) never are. One document per row."""
    slots = np.arange(q.shape[1])
    columns = jnp.arange(k_ctx.shape[1]) if key_positions is None else key_positions
    context = jnp.broadcast_to(context_rule(anchor, slots[:, None], columns[None, :], window) & (columns >= 0),
                               (slots.size, columns.size))
    own_block = jnp.asarray(block_rule(slots[:, None], slots[None, :], slots.size, causal=window is not None))
    visible = jnp.concatenate([context, own_block], axis=1)
    keys = jnp.concatenate([k_ctx, k_blk.astype(k_ctx.dtype)], axis=1)
    values = jnp.concatenate([v_ctx, v_blk.astype(v_ctx.dtype)], axis=1)
    out = grouped_attention(q, keys, values, jnp.broadcast_to(visible, (q.shape[0], *visible.shape)), scale)
    return out.astype(q.dtype)
