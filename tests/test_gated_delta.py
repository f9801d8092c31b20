"""The chunked gated delta rule against the per-token recurrence, with and without segment resets."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dflash_jax.ops.gated_delta import (chunked_gated_delta_rule, recurrent_gated_delta_rule, segment_starts,
                                        unit_lower_triangular_inverse)

HEADS, KEY_DIM, VALUE_DIM = 3, 16, 24
chunked = jax.jit(chunked_gated_delta_rule, static_argnames="chunk_size")
recurrent = jax.jit(recurrent_gated_delta_rule)


def numpy_recurrence(q, k, v, g, beta):
    """Float64 per-token reference for one row: [T, H, d] inputs -> (out [T, H, dv], state [H, dk, dv])."""
    state = np.zeros((q.shape[1], q.shape[2], v.shape[2]))
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        state = state * np.exp(g[t])[:, None, None]
        update = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t][:, :, None] * update[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], state)
    return out, state


def inputs(batch: int, length: int, seed: int = 0, decay_scale: float = 1.0):
    """Inputs as Gated DeltaNet produces them: unit-norm keys, queries scaled by dk^-0.5, β ∈ (0, 1), g ≤ 0."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((batch, length, HEADS, KEY_DIM))) * KEY_DIM**-0.5
    k = unit(rng.standard_normal((batch, length, HEADS, KEY_DIM)))
    v = rng.standard_normal((batch, length, HEADS, VALUE_DIM))
    g = -decay_scale * np.exp(rng.uniform(-3, 1, (batch, length, HEADS)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((batch, length, HEADS))))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


@pytest.mark.parametrize("length", [1, 37, 64, 150, 192])
def test_chunked_equals_recurrence(length):
    args = inputs(2, length)
    out, state = chunked(*args)
    expected_out, expected_state = recurrent(*args)
    assert out.shape == (2, length, HEADS, VALUE_DIM) and state.shape == (2, HEADS, KEY_DIM, VALUE_DIM)
    np.testing.assert_allclose(out, expected_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(state, expected_state, atol=1e-5, rtol=0)


def test_strong_decay_does_not_overflow():
    # Per-step g down to −50: in-chunk cumulative decays reach −3000, far past exp's fp32 range.
    args = inputs(1, 150, seed=1, decay_scale=20.0)
    out, state = chunked(*args)
    assert np.isfinite(out).all() and np.isfinite(state).all()
    expected_out, expected_state = recurrent(*args)
    np.testing.assert_allclose(out, expected_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(state, expected_state, atol=1e-5, rtol=0)


def test_chunk_size_does_not_change_the_result():
    args = inputs(1, 150, seed=2)
    np.testing.assert_allclose(chunked(*args, chunk_size=16)[0], chunked(*args)[0], atol=1e-5, rtol=0)


def test_segment_resets_equal_running_each_segment_alone():
    length = 200
    # Boundaries mid-chunk, on a chunk edge (64), one token before one (127), and a one-token segment (128).
    segment_ids = np.zeros((2, length), np.int32)
    for start in (40, 64, 100):
        segment_ids[0, start:] += 1
    for start in (127, 128, 129, 190):
        segment_ids[1, start:] += 1
    resets = segment_starts(segment_ids)
    args = inputs(2, length, seed=3)
    out, state = chunked(*args, resets)
    reference_out, reference_state = recurrent(*args, resets)
    np.testing.assert_allclose(out, reference_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(state, reference_state, atol=1e-5, rtol=0)
    for row in range(2):
        for segment in np.unique(segment_ids[row]):
            tokens = np.flatnonzero(segment_ids[row] == segment)
            alone_out, alone_state = numpy_recurrence(*(x[row, tokens].astype(np.float64) for x in args))
            np.testing.assert_allclose(out[row, tokens], alone_out, atol=1e-5, rtol=0)
        np.testing.assert_allclose(state[row], alone_state, atol=1e-5, rtol=0)  # the last segment's state


@pytest.mark.parametrize("rule", [chunked, recurrent])
def test_carrying_the_state_across_calls_equals_one_pass(rule):
    """Decoding: a prefill over 70 tokens (two chunks), then 1, 3 and 76 more tokens, each call starting from
    the state the previous one returned (calls shorter than a chunk use a smaller chunk)."""
    args = inputs(2, 150, seed=5)
    whole_out, whole_state = rule(*args)
    state, outs = None, []
    for start, stop in ((0, 70), (70, 71), (71, 74), (74, 150)):
        out, state = rule(*(x[:, start:stop] for x in args), None, state)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(state, whole_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rule", [chunked, recurrent])
def test_a_reset_at_the_first_token_drops_the_carried_state(rule):
    args = inputs(2, 5, seed=6)
    carried = np.random.default_rng(7).standard_normal((2, HEADS, KEY_DIM, VALUE_DIM)).astype(np.float32)
    resets = np.array([[True] + [False] * 4, [False] * 5])
    out, state = rule(*args, resets, carried)
    fresh_out, fresh_state = rule(*args)
    np.testing.assert_allclose(out[0], fresh_out[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(state[0], fresh_state[0], atol=1e-5, rtol=0)
    assert np.abs(out[1] - fresh_out[1]).max() > 1e-2  # the other row continues the carried state


def test_segment_starts():
    starts = segment_starts(np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]]))
    np.testing.assert_array_equal(starts, [[0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0]])


def test_unit_lower_triangular_inverse():
    rng = np.random.default_rng(4)
    a = np.tril(rng.standard_normal((3, 64, 64)), -1).astype(np.float32) * 0.2
    expected = np.linalg.inv(np.eye(64) + a.astype(np.float64))
    np.testing.assert_allclose(jax.jit(unit_lower_triangular_inverse)(a), expected, atol=1e-5, rtol=0)
