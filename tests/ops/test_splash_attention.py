"""The splash backend of the design §5 attention (Pallas interpreter on CPU) against the dense oracle: values and
gradients, padding, the tiles it skips, backend resolution, and the drafter on splash vs xla."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops import splash_attention
from dflash_jax.ops.attention import grouped_attention
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.mask import dense_mask, position_mask
from dflash_jax.ops.splash_attention import dflash_attention_splash, splash_tile_fraction, splash_tiles
from dflash_jax.sharding import make_mesh
from dflash_jax.weights.drafter_files import drafter_from_torch_layout
from tests.drafter_fixtures import BLOCK, FULL, SEQ_LEN, SLIDING, forward, make_config, packed_rows, random_weights

Q_HEADS, KV_HEADS, HEAD_DIM, PAD = 4, 2, 16, -1


def _segments(seq_len: int) -> np.ndarray:
    """Row 0: two documents plus padding; row 1: one document then padding."""
    first = seq_len * 2 // 5
    rows = [[0] * first + [1] * (seq_len - first - 8) + [PAD] * 8, [3] * (seq_len - 5) + [PAD] * 5]
    return np.asarray(rows, dtype=np.int32)


def _inputs(grid: AnchorGrid, seed: int):
    rng = np.random.default_rng(seed)

    def normal(length, heads):
        return jnp.asarray(rng.standard_normal((2, length, heads, HEAD_DIM)), jnp.float32)

    return (normal(grid.num_queries, Q_HEADS), normal(grid.seq_len, KV_HEADS), normal(grid.seq_len, KV_HEADS),
            normal(grid.num_queries, KV_HEADS), normal(grid.num_queries, KV_HEADS))


def _dense(grid, window, segments, scale, q, k_ctx, v_ctx, k_blk, v_blk):
    """The oracle: plain masked softmax attention over [context | blocks] under `dense_mask`."""
    keys, values = jnp.concatenate([k_ctx, k_blk], axis=1), jnp.concatenate([v_ctx, v_blk], axis=1)
    return grouped_attention(q, keys, values, dense_mask(grid, segments, window), scale)


def _splash(grid, window, segments, scale, q, k_ctx, v_ctx, k_blk, v_blk, mesh=None):
    return dflash_attention_splash(q, k_ctx, v_ctx, k_blk, v_blk, segments, segments[:, grid.anchors], grid,
                                   window, scale, mesh=mesh, interpret=True)


def _relative_error(actual, expected) -> float:
    return float(jnp.max(jnp.abs(actual - expected)) / jnp.max(jnp.abs(expected)))


# (grid, window): stride = block and < block, full and sliding layers. The last case has N*B = 192 and
# T + N*B = 288, not multiples of 128: padded queries and keys.
CASES = [
    (AnchorGrid(128, 4, 4), None),
    (AnchorGrid(128, 4, 4), 24),
    (AnchorGrid(64, 2, 4), None),
    (AnchorGrid(96, 2, 4), 10),
]


@pytest.mark.parametrize("grid, window", CASES, ids=str)
def test_splash_matches_dense_oracle_values_and_gradients(grid, window):
    segments = jnp.asarray(_segments(grid.seq_len))
    inputs = _inputs(grid, seed=grid.stride)
    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal((2, grid.num_queries, Q_HEADS, HEAD_DIM)),
                            jnp.float32)

    def value_and_grads(attention):
        out, pullback = jax.vjp(lambda *x: attention(grid, window, segments, HEAD_DIM**-0.5, *x), *inputs)
        return out, pullback(cotangent)

    out, grads = jax.jit(lambda: value_and_grads(_splash))()
    expected_out, expected_grads = value_and_grads(_dense)
    assert out.shape == expected_out.shape and out.dtype == jnp.float32
    assert _relative_error(out, expected_out) < 1e-5
    for name, grad, expected in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads, expected_grads):
        assert _relative_error(grad, expected) < 1e-4, name


@pytest.mark.parametrize("mesh_shape", [(1, 2, 2), (1, 2, 4)], ids=["heads_split", "heads_replicated"])
def test_splash_on_a_mesh_runs_per_shard(mesh_shape):
    """Given a mesh the kernel runs per shard (shard_map); values and gradients are unchanged, also when the 2
    kv heads do not split over tensor=4 and each tensor shard computes all heads."""
    grid, window = AnchorGrid(64, 2, 4), 12
    segments = jnp.asarray(_segments(grid.seq_len))
    inputs = _inputs(grid, seed=5)

    def loss(attention, *x):
        return jnp.sum(attention(grid, window, segments, HEAD_DIM**-0.5, *x) ** 2)

    expected_loss, expected_grads = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))(_dense, *inputs)
    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(data, fsdp, tensor, devices=jax.devices()[: data * fsdp * tensor])
    splash_loss = functools.partial(loss, functools.partial(_splash, mesh=mesh))
    sharded_loss, grads = jax.jit(jax.value_and_grad(splash_loss, argnums=(0, 1, 2, 3, 4)))(*inputs)
    assert "shard_map" in str(jax.make_jaxpr(splash_loss)(*inputs))
    assert _relative_error(sharded_loss, expected_loss) < 1e-5
    for grad, expected in zip(grads, expected_grads):
        assert _relative_error(grad, expected) < 1e-4


def test_bfloat16_inputs():
    grid, window = AnchorGrid(128, 4, 4), None
    segments = jnp.asarray(_segments(grid.seq_len))
    inputs = _inputs(grid, seed=7)
    out = jax.jit(lambda *x: _splash(grid, window, segments, HEAD_DIM**-0.5, *x))(
        *(x.astype(jnp.bfloat16) for x in inputs))
    assert out.dtype == jnp.bfloat16
    assert _relative_error(out.astype(jnp.float32), _dense(grid, window, segments, HEAD_DIM**-0.5, *inputs)) < 2e-2


@pytest.mark.parametrize("window", [None, 40])
def test_kernel_skips_exactly_the_empty_tiles(window):
    """The kernel's forward tile info marks as computed exactly the tiles `splash_tile_fraction` reports."""
    grid = AnchorGrid(640, 4, 4)  # 640 queries x 1280 keys: tiles 128 x 256 (640 = 5 * 128, 1280 = 5 * 256)
    assert splash_tiles(grid) == (128, 256)
    block_mask = np.asarray(splash_attention._kernel(grid, window, Q_HEADS, True).fwd_mask_info.block_mask)
    # One copy of the tile info, shared by all heads; each query-tile row lists only its non-empty key tiles
    # (the kernel shrinks the key axis of its grid to the longest such list, padding with empty entries).
    assert block_mask.shape[:2] == (1, 5) and block_mask.shape[2] <= 5
    assert (block_mask > 0).sum() / 25 == splash_tile_fraction(grid, window) < 1
    # The kernel needs every query row, padded ones included, to see at least one key.
    grid = AnchorGrid(96, 2, 4)
    assert splash_attention.GridMask(grid, window)[:, :].any(axis=1).all()


def test_tile_fractions_of_the_27b_shape():
    grid = AnchorGrid(4096, 16, 16)
    assert splash_tiles(grid) == (512, 512)
    assert splash_tile_fraction(grid, None) == pytest.approx(0.34375)
    assert splash_tile_fraction(grid, 2048) == pytest.approx(0.296875)


def test_bad_shapes_are_refused():
    grid = AnchorGrid(128, 4, 4)
    q, k_ctx, v_ctx, k_blk, v_blk = _inputs(grid, seed=0)
    segments = jnp.asarray(_segments(grid.seq_len))
    with pytest.raises(ValueError, match=r"k_ctx has shape \(2, 64, 2, 16\), expected leading dimensions \(2, 128\)"):
        dflash_attention_splash(q, k_ctx[:, :64], v_ctx, k_blk, v_blk, segments, segments[:, grid.anchors], grid,
                                None, 1.0, interpret=True)


def test_resolve_attention_impl(monkeypatch):
    assert resolve_attention_impl("auto") == "xla"  # these tests run on CPU
    assert resolve_attention_impl("splash") == "splash" and resolve_attention_impl("xla") == "xla"
    with pytest.raises(ValueError,
                       match=r"attention_impl must be one of \['auto', 'cudnn', 'splash', 'xla'\], got 'flash'"):
        resolve_attention_impl("flash")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_attention_impl("auto") == "splash"


@pytest.mark.parametrize("layer_types, window, stride", [
    ((SLIDING, FULL), 5, 2), pytest.param((FULL, FULL), None, 4, marks=pytest.mark.slow)])
def test_drafter_on_splash_matches_xla(layer_types, window, stride, caplog):
    """The tiny drafter config of test_drafter (N*B and T + N*B far below 128: padded) on both backends."""
    config = make_config(layer_types, window)
    weights = random_weights(config, seed=stride)
    features, _, positions, segments = packed_rows(stride, len(config.target_layer_ids))
    grid = AnchorGrid(SEQ_LEN, stride, BLOCK)
    embeds = np.random.default_rng(2).standard_normal((2, grid.num_queries, config.hidden_size))
    args = (jnp.asarray(features), jnp.asarray(embeds, jnp.float32), jnp.asarray(positions), jnp.asarray(segments),
            grid)
    hidden = {}
    for impl in ("xla", "splash"):
        with caplog.at_level(logging.WARNING, logger=splash_attention.__name__):
            drafter = drafter_from_torch_layout(weights, config, attention_impl=impl, query_chunk_blocks=2)
            hidden[impl] = np.asarray(forward(drafter, *args))
    assert "Pallas interpreter" in caplog.text  # splash off TPU: interpreted, with a warning
    assert drafter.attention_impl == "splash"
    assert _relative_error(hidden["splash"], hidden["xla"]) < 1e-5


@pytest.mark.parametrize("grid", [AnchorGrid(96, 2, 4), AnchorGrid(64, 8, 16), AnchorGrid(200, 8, 8)])
@pytest.mark.parametrize("window", [None, 3, 40])
def test_grid_mask_is_the_position_mask_padded(grid, window):
    """The computed mask the kernel evaluates is design §5's position mask on the real queries and keys; padded
    keys are invisible and a padded query sees exactly the last block key."""
    computed = splash_attention.GridMask(grid, window)[:, :]
    queries, keys = grid.num_queries, grid.seq_len + grid.num_queries
    assert computed.shape == tuple(-(-n // 128) * 128 for n in (queries, keys))
    np.testing.assert_array_equal(computed[:queries, :keys], position_mask(grid, window))
    assert not computed[:, keys:].any()
    assert (computed[queries:] == (np.arange(computed.shape[1]) == keys - 1)).all()
