"""The design §5 mask: the dense oracle against the loop definition, its invariants, and the chunked XLA
attention against dense attention under the oracle (values, gradients, and the arrays it builds)."""

from __future__ import annotations

import math

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from dflash_jax.ops.attention import grouped_attention
from dflash_jax.ops.dflash_attention import KEY_TILE, context_reach, dflash_attention, tile_schedule
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.mask import dense_mask, position_mask, tile_fraction, visible_intervals
from tests.torch_reference import reference_mask

PAD = -1
# Stride below, equal to and above the block size.
GRIDS = [AnchorGrid(24, 2, 4), AnchorGrid(24, 4, 4), AnchorGrid(24, 8, 4), AnchorGrid(24, 6, 3)]
WINDOWS = [None, 1, 3, 6, 100]


def _segments(seq_len: int) -> np.ndarray:
    """Row 0: two documents plus padding; row 1: one document then padding; row 2: a single document."""
    first = seq_len * 2 // 5
    rows = [[0] * first + [1] * (seq_len - first - 4) + [PAD] * 4,
            [3] * (seq_len - 5) + [PAD] * 5,
            [7] * seq_len]
    return np.asarray(rows, dtype=np.int32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_dense_mask_equals_loop_definition(grid, window):
    segments = _segments(grid.seq_len)
    mask = np.asarray(dense_mask(grid, segments, window))
    assert mask.shape == (3, grid.num_queries, grid.seq_len + grid.num_queries)
    for row, segment_ids in enumerate(segments):
        expected = reference_mask(segment_ids.tolist(), grid.anchors.tolist(), grid.block_size, window).numpy()
        np.testing.assert_array_equal(mask[row], expected)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_mask_invariants(grid, window):
    segments = _segments(grid.seq_len)
    mask = np.asarray(dense_mask(grid, segments, window))
    context, blocks = mask[:, :, : grid.seq_len], mask[:, :, grid.seq_len:]
    B = grid.block_size
    for j, anchor in enumerate(grid.anchors):
        rows = slice(j * B, (j + 1) * B)
        # Strict p < a: nothing at or after the anchor's own position (design §12.4).
        assert not context[:, rows, anchor:].any()
        own_block = blocks[:, rows, rows]
        expected_block = np.ones((B, B), bool) if window is None else np.tril(np.ones((B, B), bool))
        assert (own_block == expected_block).all()
        other_blocks = np.delete(blocks[:, rows], np.s_[rows], axis=2)
        assert not other_blocks.any()
        for row, segment_ids in enumerate(segments):
            visible_positions = np.nonzero(context[row, rows].any(axis=0))[0]
            assert (segment_ids[visible_positions] == segment_ids[anchor]).all()  # never across documents
    assert mask.any(axis=2).all()  # no fully masked query row: each sees its own slot


def test_sliding_window_example():
    """Window 3, anchor 8: slot 0 sees context 6, 7; slot 1 sees 7; slot 2 sees nothing (8+2-3 < p < 8)."""
    grid = AnchorGrid(16, 8, 4)
    mask = np.asarray(dense_mask(grid, np.zeros((1, 16), np.int32), 3))[0]
    visible = [np.nonzero(mask[grid.block_size + k, :16])[0].tolist() for k in range(4)]
    assert visible == [[6, 7], [7], [], []]
    full = np.asarray(dense_mask(grid, np.zeros((1, 16), np.int32), None))[0]
    assert np.nonzero(full[grid.block_size + 3, :16])[0].tolist() == list(range(8))


def test_position_mask_is_dense_mask_of_one_document():
    grid = AnchorGrid(24, 4, 4)
    for window in (None, 5):
        one_document = np.asarray(dense_mask(grid, np.zeros((1, 24), np.int32), window))[0]
        np.testing.assert_array_equal(position_mask(grid, window), one_document)


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_len=24, stride=5, block_size=4), "seq_len .* multiple of AnchorGrid.stride"),
    (dict(seq_len=24, stride=4, block_size=1), "block_size must be >= 2"),
    (dict(seq_len=0, stride=4, block_size=4), "AnchorGrid.seq_len must be a positive int"),
    (dict(seq_len=24, stride=0, block_size=4), "AnchorGrid.stride must be a positive int"),
])
def test_anchor_grid_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AnchorGrid(**kwargs)


def test_anchor_grid_layout():
    grid = AnchorGrid(24, 6, 3)
    assert grid.num_anchors == 4 and grid.num_queries == 12
    np.testing.assert_array_equal(grid.anchors, [0, 6, 12, 18])
    np.testing.assert_array_equal(grid.query_anchors, np.repeat([0, 6, 12, 18], 3))
    np.testing.assert_array_equal(grid.query_slots, np.tile([0, 1, 2], 4))
    with pytest.raises(ValueError, match="window"):
        position_mask(grid, 0)


def test_tile_fraction():
    grid = AnchorGrid(64, 4, 4)
    mask = position_mask(grid, None)
    assert tile_fraction(grid, None, 1, 1) == pytest.approx(mask.mean())
    assert tile_fraction(grid, None, mask.shape[0], mask.shape[1]) == 1.0
    # Brute force over 16 x 16 tiles, the last key tile column overhanging the mask (128 keys = 8 tiles).
    tiles = [[mask[r:r + 16, c:c + 16].any() for c in range(0, mask.shape[1], 16)]
             for r in range(0, mask.shape[0], 16)]
    assert tile_fraction(grid, None, 16, 16) == pytest.approx(np.mean(tiles))
    assert tile_fraction(grid, None, 16, 24) == pytest.approx(
        np.mean([[mask[r:r + 16, c:c + 24].any() for c in range(0, 128, 24)] for r in range(0, 64, 16)]))
    assert tile_fraction(grid, 8, 16, 16) < tile_fraction(grid, None, 16, 16) < 1.0
    # Sliding windows, ragged tiles: brute force over the mask.
    for window, q_tile, k_tile in [(8, 16, 16), (5, 12, 20), (40, 7, 9)]:
        mask = position_mask(grid, window)
        tiles = [[mask[r:r + q_tile, c:c + k_tile].any() for c in range(0, mask.shape[1], k_tile)]
                 for r in range(0, mask.shape[0], q_tile)]
        assert tile_fraction(grid, window, q_tile, k_tile) == pytest.approx(np.mean(tiles))


# ---- chunked XLA attention against dense attention under the oracle ----

def _attention_inputs(grid: AnchorGrid, seed: int, q_heads=4, kv_heads=2, head_dim=8):
    keys = jax.random.split(jax.random.key(seed), 5)
    batch = 3
    q = jax.random.normal(keys[0], (batch, grid.num_queries, q_heads, head_dim))
    k_ctx = jax.random.normal(keys[1], (batch, grid.seq_len, kv_heads, head_dim))
    v_ctx = jax.random.normal(keys[2], (batch, grid.seq_len, kv_heads, head_dim))
    k_blk = jax.random.normal(keys[3], (batch, grid.num_queries, kv_heads, head_dim))
    v_blk = jax.random.normal(keys[4], (batch, grid.num_queries, kv_heads, head_dim))
    return q, k_ctx, v_ctx, k_blk, v_blk


def _chunked(grid, window, chunk, key_tile=KEY_TILE):
    def attend(q, k_ctx, v_ctx, k_blk, v_blk, segments):
        return dflash_attention(q, k_ctx, v_ctx, k_blk, v_blk, segments, segments[:, grid.anchors], grid, window,
                                0.35, query_chunk_blocks=chunk, key_tile=key_tile)
    return attend


def _dense(grid, window):
    def attend(q, k_ctx, v_ctx, k_blk, v_blk, segments):
        keys, values = jnp.concatenate([k_ctx, k_blk], 1), jnp.concatenate([v_ctx, v_blk], 1)
        return grouped_attention(q, keys, values, dense_mask(grid, segments, window), 0.35)
    return attend


def _output_and_grads(attend, inputs, segments, cotangent):
    """attend's output and the gradients of sum(output * cotangent) w.r.t. q, k_ctx, v_ctx, k_blk, v_blk."""
    def loss(*arrays):
        out = attend(*arrays, segments)
        return jnp.sum(out * cotangent), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*inputs)
    return out, grads


ATTENTION_CASES = [  # grid, window, query chunk blocks, key tile
    (AnchorGrid(32, 4, 4), None, 1, KEY_TILE),
    (AnchorGrid(32, 4, 4), None, 3, KEY_TILE),  # last chunk shorter
    (AnchorGrid(32, 4, 4), None, 8, KEY_TILE),  # one chunk: the whole
    (AnchorGrid(32, 4, 4), None, 3, 5),  # several tiles a chunk
    (AnchorGrid(32, 4, 4), 6, 3, 7),  # a tile and the last chunk moved back into the row
    (AnchorGrid(32, 2, 4), 5, 4, 5),  # stride < block
    (AnchorGrid(32, 8, 4), None, 2, 5),  # stride > block
    (AnchorGrid(32, 8, 4), 3, 3, KEY_TILE),
    (AnchorGrid(64, 4, 4), None, 3, 7),
    (AnchorGrid(64, 4, 4), 9, 3, 4),
    (AnchorGrid(32, 4, 4), 100, 3, 6),  # a window wider than the row
]


@pytest.mark.parametrize("grid, window, chunk, key_tile", ATTENTION_CASES, ids=str)
def test_dflash_attention_equals_dense(grid, window, chunk, key_tile):
    """Forward and gradients of the tiled attention (its own backward) equal dense attention under the oracle
    mask and autodiff."""
    inputs = _attention_inputs(grid, seed=chunk)
    segments = jnp.asarray(_segments(grid.seq_len))
    cotangent = jax.random.normal(jax.random.key(7), inputs[0].shape)
    out, grads = _output_and_grads(_chunked(grid, window, chunk, key_tile), inputs, segments, cotangent)
    expected_out, expected_grads = _output_and_grads(_dense(grid, window), inputs, segments, cotangent)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    for name, grad, expected_grad in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads, expected_grads):
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-5, err_msg=name)


def test_cases_move_a_tile_and_a_chunk_back_into_the_row():
    """The clipped tile and chunk (their counted part starting past their start) are among the cases above."""
    schedules = [tile_schedule(grid, window, chunk, key_tile) for grid, window, chunk, key_tile in ATTENTION_CASES]
    assert any((s.key_start < s.key_low).any() and (s.row_start < s.row_low).any() for s in schedules)


def test_dflash_attention_in_bf16_matches_fp32():
    """bf16 operands (the step's compute dtype): output and gradients within bf16 rounding of the fp32 ones."""
    grid = AnchorGrid(64, 4, 4)
    inputs = _attention_inputs(grid, seed=5, head_dim=16)
    segments = jnp.asarray(_segments(grid.seq_len))
    cotangent = jax.random.normal(jax.random.key(8), inputs[0].shape)
    attend = _chunked(grid, 9, 3, key_tile=8)
    out, grads = _output_and_grads(attend, [x.astype(jnp.bfloat16) for x in inputs], segments,
                                   cotangent.astype(jnp.bfloat16))
    expected_out, expected_grads = _output_and_grads(attend, inputs, segments, cotangent)
    assert out.dtype == jnp.bfloat16 and all(grad.dtype == jnp.bfloat16 for grad in grads)
    np.testing.assert_allclose(out.astype(jnp.float32), expected_out, rtol=3e-2, atol=3e-2)
    for grad, expected_grad in zip(grads, expected_grads):
        scale = float(jnp.max(jnp.abs(expected_grad)))
        assert float(jnp.max(jnp.abs(grad.astype(jnp.float32) - expected_grad))) < 3e-2 * scale


def test_dflash_attention_checks_shapes_and_sizes():
    grid = AnchorGrid(16, 4, 4)
    inputs = _attention_inputs(grid, seed=0)
    segments = jnp.zeros((3, 16), jnp.int32)
    with pytest.raises(ValueError, match="k_ctx has shape"):
        _chunked(grid, None, 2)(inputs[0], inputs[1][:, :8], *inputs[2:], segments)
    with pytest.raises(ValueError, match="key_tile must be >= 1"):
        _chunked(grid, None, 2, key_tile=0)(*inputs, segments)


def _largest_array(jaxpr) -> int:
    """Element count of the largest value any equation (nested jaxprs included) produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, math.prod(getattr(var.aval, "shape", ())))
        for sub in jex.core.jaxprs_in_params(eqn.params):
            largest = max(largest, _largest_array(sub))
    return largest


@pytest.mark.parametrize("window", [None, 9])
def test_tiled_attention_never_builds_full_scores(window):
    """Forward and backward hold one pair's scores (a chunk's rows against a key tile) and each row's scores
    against its own block, never a row's whole context."""
    grid = AnchorGrid(64, 4, 4)
    inputs = _attention_inputs(grid, seed=1, head_dim=1)  # 1-wide heads, so the scores are the largest arrays
    segments = jnp.asarray(_segments(grid.seq_len))
    batch, q_heads = inputs[0].shape[0], inputs[0].shape[2]
    full_scores = batch * q_heads * grid.num_queries * (grid.seq_len + grid.num_queries)
    own_blocks = batch * q_heads * grid.num_queries * grid.block_size

    def largest(attend):
        forward = jax.make_jaxpr(attend)(*inputs, segments).jaxpr
        cotangent = jnp.ones(inputs[0].shape)
        backward = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(attend(*a, segments) * cotangent),
                                           argnums=(0, 1, 2, 3, 4)))(*inputs).jaxpr
        return max(_largest_array(forward), _largest_array(backward))

    sizes = {}
    for chunk, key_tile in ((4, 16), (16, 16), (16, KEY_TILE)):
        schedule = tile_schedule(grid, window, chunk, key_tile)
        pair_scores = batch * q_heads * schedule.chunk_rows * schedule.width
        sizes[chunk, key_tile] = largest(_chunked(grid, window, chunk, key_tile))
        assert sizes[chunk, key_tile] == max(pair_scores, own_blocks)
    # The measurement does see the scores grow with the pair: one chunk over whole-reach tiles is over 4x.
    assert 4 * sizes[4, 16] < full_scores and 4 * sizes[4, 16] < sizes[16, KEY_TILE]


def _score_elements(jaxpr, head_dim: int) -> int:
    """Elements of every matmul output that is a score array (its last axis is not head_dim), nested
    jaxprs included (a loop's body once)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape[-1] != head_dim:
            total += math.prod(eqn.outvars[0].aval.shape)
        for sub in jex.core.jaxprs_in_params(eqn.params):
            total += _score_elements(sub, head_dim)
    return total


@pytest.mark.parametrize("window", [None, 9])
def test_scores_are_one_pair_and_the_own_blocks(window):
    """The forward scores a chunk's queries against one key tile per trip of its scan, and every row against its
    own block's B slots: never another block's slots (the dense form's N*B x N*B block part, all but B x B per
    block masked)."""
    grid, chunk, head_dim = AnchorGrid(64, 4, 4), 3, 6
    inputs = _attention_inputs(grid, seed=2, head_dim=head_dim)
    segments = jnp.asarray(_segments(grid.seq_len))
    batch, q_heads = inputs[0].shape[0], inputs[0].shape[2]
    schedule = tile_schedule(grid, window, chunk, 8)
    expected = batch * q_heads * (schedule.chunk_rows * schedule.width + grid.num_queries * grid.block_size)
    forward = jax.make_jaxpr(_chunked(grid, window, chunk, 8))(*inputs, segments).jaxpr
    assert _score_elements(forward, head_dim) == expected


@pytest.mark.parametrize("window", [None, 1, 5, 9, 40, 100])
@pytest.mark.parametrize("grid", [AnchorGrid(64, 4, 4), AnchorGrid(64, 2, 4), AnchorGrid(96, 8, 4)], ids=str)
@pytest.mark.parametrize("chunk, key_tile", [(1, 5), (2, KEY_TILE), (3, 7), (7, 4), (100, 9)])
def test_tiles_count_every_chunks_reach_once(grid, window, chunk, key_tile):
    """Each chunk's pairs count its rows (in order, every row once over the chunks) and positions that hold its
    reach, no position twice, scoring less than one tile beyond it; every slice lies in the row."""
    schedule = tile_schedule(grid, window, chunk, key_tile)
    blocks = min(chunk, grid.num_anchors)
    assert schedule.chunk_rows == blocks * grid.block_size and schedule.width <= max(key_tile, 1)
    for first in range(0, grid.num_anchors, blocks):
        start, stop = context_reach(grid, window, first, min(first + blocks, grid.num_anchors))
        mine = schedule.row_low == first * grid.block_size
        rows = set(range(first * grid.block_size, min(first + blocks, grid.num_anchors) * grid.block_size))
        counted = []
        for row_start, row_low, key_start, key_low in zip(*(getattr(schedule, name)[mine] for name in (
                "row_start", "row_low", "key_start", "key_low"))):
            assert set(range(row_low, row_start + schedule.chunk_rows)) == rows and row_start >= 0
            assert 0 <= key_start <= key_low and key_start + schedule.width <= grid.seq_len
            counted += range(key_low, key_start + schedule.width)
        assert len(counted) == len(set(counted)) and set(range(start, stop)) <= set(counted)
        assert mine.sum() * schedule.width < max(stop - start, 1) + schedule.width
    assert sorted(schedule.row_low) == list(schedule.row_low)


@pytest.mark.parametrize("window", [None, 2048])
def test_tiles_score_at_most_a_tenth_more_than_each_chunks_reach(window):
    """The 27B recipe's grid (T 4096, stride 8, B 16) in chunks of 16 blocks: a layer's pairs score at most 1.1
    times the context positions each chunk's own reach holds; a sliding layer's windowed chunks (reach (C-1)*S +
    W - 1) fill whole tiles."""
    grid, chunk = AnchorGrid(4096, 8, 16), 16
    needed = sum(np.subtract(*context_reach(grid, window, first, first + chunk)[::-1])
                 for first in range(0, grid.num_anchors, chunk))
    schedule = tile_schedule(grid, window, chunk)
    assert needed < schedule.pairs * schedule.width <= needed * 1.1
    if window is not None:
        assert schedule.width * 5 == 15 * 8 + 2047 + 3  # five tiles of 434 positions


def _equations(jaxpr) -> int:
    """Equations of a jaxpr, nested jaxprs included: the size of the program handed to the compiler."""
    return sum(1 + sum(_equations(sub) for sub in jex.core.jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns)


@pytest.mark.parametrize("window", [None, 9])
def test_program_does_not_grow_with_the_chunk_count(window):
    """Forward and backward are programs of one size whatever the chunking (a shorter last chunk included):
    one scan body each, not code per chunk."""
    grid = AnchorGrid(64, 2, 4)  # 32 blocks
    inputs = _attention_inputs(grid, seed=3)
    segments = jnp.asarray(_segments(grid.seq_len))

    def size(chunk):
        attend = _chunked(grid, window, chunk, key_tile=8)
        backward = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(attend(*a, segments)), argnums=(0, 1, 2, 3, 4)))
        return _equations(backward(*inputs).jaxpr)

    sizes = {chunk: size(chunk) for chunk in (32, 8, 5, 2, 1)}
    assert len(set(sizes.values())) == 1, sizes


@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_visible_intervals_are_the_position_mask(window):
    grid = AnchorGrid(48, 4, 6)
    starts, ends = visible_intervals(grid, window)
    keys = np.arange(grid.seq_len + grid.num_queries)
    inside = (keys >= starts[:, :, None]) & (keys < ends[:, :, None])
    np.testing.assert_array_equal(inside.any(axis=1), position_mask(grid, window))


# ---- rows split over the context axis (design §19) ----

def _split_segments(seq_len: int) -> np.ndarray:
    """Documents crossing every split of the row into 2-8 shards, and a row whose last quarter (a whole shard at 4
    shards, two at 8) is padding."""
    first = np.repeat([0, 1, 2, 3], [seq_len * 3 // 8 + 1, seq_len // 4 + 3, 5, seq_len - seq_len * 5 // 8 - 9])
    second = np.repeat([4, 5, PAD], [seq_len // 2 - 3, seq_len // 4 + 3, seq_len // 4])
    return np.stack([first, second, np.full(seq_len, 6)]).astype(np.int32)


# make test: the full layer (the prefix all-gathered) and a sliding layer wider than a shard (halo from three
# shards); make test-slow: the other splits and a halo narrower than a shard.
@pytest.mark.parametrize("shards, window, chunk, key_tile", [
    (4, None, 3, 7), (8, 20, 3, 5),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [(2, None, 2, KEY_TILE), (8, None, 1, 5),
                                                               (4, 5, 2, KEY_TILE), (2, 9, 3, 4)]]])
def test_dflash_attention_on_rows_split_over_context_equals_one_device(shards, window, chunk, key_tile):
    """Each shard attends for its own anchors' blocks against its halo and its own context (forward and
    gradients); a sliding layer's halo comes by collective permutes, the full layer's prefix by one all-gather."""
    grid = AnchorGrid(64, 4, 4)
    inputs = _attention_inputs(grid, seed=shards)
    segments = jnp.asarray(_split_segments(grid.seq_len))
    cotangent = jax.random.normal(jax.random.key(7), inputs[0].shape)
    attend = _chunked(grid, window, chunk, key_tile)
    expected_out, expected_grads = _output_and_grads(attend, inputs, segments, cotangent)
    with jax.set_mesh(Mesh(np.array(jax.devices()[:shards]), ("context",))):
        out, grads = _output_and_grads(attend, inputs, segments, cotangent)
        hlo = jax.jit(attend).lower(*inputs, segments).compile().as_text()
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    for name, grad, expected_grad in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads, expected_grads):
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-5, err_msg=name)
    gathers = "all-gather" in hlo
    assert gathers == (window is None) and ("collective-permute" in hlo) == (window is not None)


def test_bf16_gradients_of_a_split_full_layer_compile_beside_a_tensor_axis():
    """The full layer's prefix gather in bf16 on a (context, tensor) mesh: its gradient (a reduce-scatter) once
    aborted XLA:CPU's compiler; the gradients equal one device's within bf16's precision."""
    grid = AnchorGrid(64, 4, 4)
    inputs = tuple(x.astype(jnp.bfloat16) for x in _attention_inputs(grid, seed=3))
    segments = jnp.asarray(_split_segments(grid.seq_len))
    cotangent = jax.random.normal(jax.random.key(7), inputs[0].shape).astype(jnp.bfloat16)
    attend = _chunked(grid, None, 3, 7)
    _, expected_grads = _output_and_grads(attend, inputs, segments, cotangent)
    with jax.set_mesh(Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("context", "tensor"))):
        _, grads = _output_and_grads(attend, inputs, segments, cotangent)
    for name, grad, expected_grad in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads, expected_grads):
        np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(expected_grad, np.float32),
                                   rtol=0.05, atol=0.05, err_msg=name)
