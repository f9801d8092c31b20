"""The design §5 mask: the dense oracle against the loop definition, its invariants, and the chunked XLA
attention against dense attention under the oracle (values, gradients, and the arrays it builds)."""

from __future__ import annotations

import math

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops.attention import grouped_attention
from dflash_jax.ops.dflash_attention import (PREFIX_RUNS, PREFIX_WASTE, chunk_runs, context_reach,
                                            dflash_attention, reach_start)
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.mask import dense_mask, position_mask, tile_fraction
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


def _chunked(grid, window, chunk):
    def attend(q, k_ctx, v_ctx, k_blk, v_blk, segments):
        return dflash_attention(q, k_ctx, v_ctx, k_blk, v_blk, segments, segments[:, grid.anchors], grid, window,
                                0.35, query_chunk_blocks=chunk)
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


@pytest.mark.parametrize("grid, window, chunk", [
    (AnchorGrid(32, 4, 4), None, 1),
    (AnchorGrid(32, 4, 4), None, 3),  # last chunk shorter
    (AnchorGrid(32, 4, 4), None, 8),  # one chunk: the whole
    (AnchorGrid(32, 4, 4), 6, 3),
    (AnchorGrid(32, 2, 4), 5, 4),  # stride < block
    (AnchorGrid(32, 8, 4), None, 2),  # stride > block
    (AnchorGrid(32, 8, 4), 3, 3),
    (AnchorGrid(64, 4, 4), None, 3),  # four runs of full reach and a shorter last chunk
    (AnchorGrid(64, 4, 4), 9, 3),  # the last chunks' windows moved back into the row
    (AnchorGrid(32, 4, 4), 100, 3),  # a window wider than the row
], ids=str)
def test_dflash_attention_equals_dense(grid, window, chunk):
    """Forward and gradients of the chunked attention equal dense attention under the oracle mask."""
    inputs = _attention_inputs(grid, seed=chunk)
    segments = jnp.asarray(_segments(grid.seq_len))
    cotangent = jax.random.normal(jax.random.key(7), inputs[0].shape)
    out, grads = _output_and_grads(_chunked(grid, window, chunk), inputs, segments, cotangent)
    expected_out, expected_grads = _output_and_grads(_dense(grid, window), inputs, segments, cotangent)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    for name, grad, expected_grad in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads, expected_grads):
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-5, err_msg=name)


def test_dflash_attention_keeps_dtype_and_checks_shapes():
    grid = AnchorGrid(16, 4, 4)
    inputs = [x.astype(jnp.bfloat16) for x in _attention_inputs(grid, seed=0)]
    segments = jnp.zeros((3, 16), jnp.int32)
    assert jax.jit(_chunked(grid, None, 2))(*inputs, segments).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="k_ctx has shape"):
        _chunked(grid, None, 2)(inputs[0], inputs[1][:, :8], *inputs[2:], segments)


def _largest_array(jaxpr) -> int:
    """Element count of the largest value any equation (nested jaxprs included) produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, math.prod(getattr(var.aval, "shape", ())))
        for sub in jex.core.jaxprs_in_params(eqn.params):
            largest = max(largest, _largest_array(sub))
    return largest


def _chunk_scores(grid, window, batch, q_heads, chunk) -> int:
    """Element count of the largest per-chunk score array the documented bound allows: a chunk's C*B queries
    against its run's context reach, or against their own block's B slots if that is wider."""
    widest = max([grid.block_size] + [run.reach for run in chunk_runs(grid, window, chunk)])
    return batch * q_heads * chunk * grid.block_size * widest


@pytest.mark.parametrize("window", [None, 9])
def test_chunked_attention_never_builds_full_scores(window):
    grid = AnchorGrid(64, 4, 4)
    inputs = _attention_inputs(grid, seed=1, head_dim=1)  # 1-wide heads, so the scores are the largest arrays
    segments = jnp.asarray(_segments(grid.seq_len))
    batch, q_heads = inputs[0].shape[0], inputs[0].shape[2]
    full_scores = batch * q_heads * grid.num_queries * (grid.seq_len + grid.num_queries)
    chunk = 2
    chunk_scores = _chunk_scores(grid, window, batch, q_heads, chunk)
    assert chunk_scores * 4 < full_scores

    def largest(attend):
        forward = jax.make_jaxpr(attend)(*inputs, segments).jaxpr
        cotangent = jnp.ones(inputs[0].shape)
        backward = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(attend(*a, segments) * cotangent),
                                           argnums=(0, 1, 2, 3, 4)))(*inputs).jaxpr
        return max(_largest_array(forward), _largest_array(backward))

    assert largest(_chunked(grid, window, chunk)) == chunk_scores
    # The same measurement does see a chunk's scores grow with the chunk: one chunk covers every query.
    single = _chunk_scores(grid, window, batch, q_heads, grid.num_anchors)
    assert largest(_chunked(grid, window, grid.num_anchors)) == single > 4 * chunk_scores


def _score_elements(jaxpr, head_dim: int) -> int:
    """Elements of every matmul output that is a score array (its last axis is not head_dim), nested
    jaxprs included."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape[-1] != head_dim:
            total += math.prod(eqn.outvars[0].aval.shape)
        for sub in jex.core.jaxprs_in_params(eqn.params):
            total += _score_elements(sub, head_dim)
    return total


@pytest.mark.parametrize("window", [None, 9])
def test_scores_cover_each_runs_reach_and_own_blocks_only(window):
    """The forward's one scan body per run scores a chunk's queries against the run's context reach plus their
    own block's B slots: never another block's slots (the dense form's N*B x N*B block part, all but B x B per
    block masked)."""
    grid, chunk, head_dim = AnchorGrid(64, 4, 4), 3, 6
    inputs = _attention_inputs(grid, seed=2, head_dim=head_dim)
    segments = jnp.asarray(_segments(grid.seq_len))
    batch, q_heads = inputs[0].shape[0], inputs[0].shape[2]
    expected = sum(batch * q_heads * run.blocks * grid.block_size * (run.reach + grid.block_size)
                   for run in chunk_runs(grid, window, chunk))
    forward = jax.make_jaxpr(_chunked(grid, window, chunk))(*inputs, segments).jaxpr
    assert _score_elements(forward, head_dim) == expected


@pytest.mark.parametrize("window", [None, 1, 5, 9, 40, 100])
@pytest.mark.parametrize("grid", [AnchorGrid(64, 4, 4), AnchorGrid(64, 2, 4), AnchorGrid(96, 8, 4)], ids=str)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_chunk_runs_cover_every_chunks_reach(grid, window, chunk):
    """The runs tile the blocks in chunks of `chunk` (a shorter last one), and each chunk's scored positions
    [start, start + reach) hold every context position its anchors see; at most PREFIX_RUNS prefix runs, one
    windowed run and the shorter last chunk's, whatever the number of chunks."""
    runs = chunk_runs(grid, window, chunk)
    assert len(runs) <= PREFIX_RUNS + 2 and sum(run.windowed for run in runs) <= 2
    first = 0
    for run in runs:
        assert run.first_block == first and 0 <= run.reach <= grid.seq_len
        for index in range(run.chunks):
            begin = run.first_block + index * run.blocks
            start, stop = context_reach(grid, window, begin, begin + run.blocks)
            scored = int(reach_start(grid, window, run, int(grid.anchors[begin])))
            assert scored <= start and stop <= scored + run.reach, (run, begin)
        first = run.end_block
    assert first == grid.num_anchors
    assert [run.blocks for run in runs[:-1]] == [min(chunk, grid.num_anchors)] * (len(runs) - 1)


@pytest.mark.parametrize("window", [None, 2048])
def test_runs_score_at_most_a_quarter_more_than_each_chunks_reach(window):
    """The 27B recipe's grid (T 4096, stride 8, B 16) in chunks of 16 blocks: a layer's runs score at most
    PREFIX_WASTE times the context positions each chunk's own reach holds; a sliding layer (W 2048) scans the
    chunks whose window lies in the row in one run of the window's width."""
    grid, chunk = AnchorGrid(4096, 8, 16), 16
    needed = sum(np.subtract(*context_reach(grid, window, first, first + chunk)[::-1])
                 for first in range(0, grid.num_anchors, chunk))
    runs = chunk_runs(grid, window, chunk)
    assert needed < sum(run.chunks * run.reach for run in runs) <= needed * PREFIX_WASTE
    if window is not None:
        assert runs[-1].windowed and runs[-1].chunks == 16 and runs[-1].reach == 15 * 8 + 2047


def _equations(jaxpr) -> int:
    """Equations of a jaxpr, nested jaxprs included: the size of the program handed to the compiler."""
    return sum(1 + sum(_equations(sub) for sub in jex.core.jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns)


@pytest.mark.parametrize("window", [None, 9])
def test_program_does_not_grow_with_the_chunk_count(window):
    """Forward and backward of 16 and 32 chunks are programs of the same size, and no chunking's program is
    larger than PREFIX_RUNS + 2 one-chunk programs: one scan body per run, not code per chunk."""
    grid = AnchorGrid(64, 2, 4)  # 32 blocks
    inputs = _attention_inputs(grid, seed=3)
    segments = jnp.asarray(_segments(grid.seq_len))

    def size(chunk):
        attend = _chunked(grid, window, chunk)
        backward = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(attend(*a, segments)), argnums=(0, 1, 2, 3, 4)))
        return _equations(backward(*inputs).jaxpr)

    sizes = {chunk: size(chunk) for chunk in (32, 8, 2, 1)}
    assert sizes[2] == sizes[1]
    assert max(sizes.values()) <= (PREFIX_RUNS + 2) * sizes[32], sizes
