"""DFlash2's parts of the drafter (design §18.4): the block convolution against its formula written as loops, its
identity at initialisation (the whole drafter's output then equals DFlash's, in training and decoding), the
config checks, the training candidates and the selector's greedy walk against a loop over slots."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.dflash2 import block_convolution, training_candidates
from dflash_jax.models.drafter import DecodeStep, Drafter
from dflash_jax.ops.anchors import AnchorGrid
from tests.drafter_fixtures import BLOCK, FULL, HIDDEN, SEQ_LEN, SLIDING, VOCAB, forward, make_config, packed_rows

DFLASH2 = dict(method="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5)


def loop_convolution(x, delta, base, block_size):
    """out[i, c] = Σ_{t < K, slot(i) >= t} (base[t, c] + delta[i, t, c // (H/G)]) · x[i - t, c], one entry at a
    time (x [Q, H], delta [Q, K, G], base [K, H])."""
    rows, hidden = x.shape
    taps, groups = delta.shape[1:]
    out = np.zeros_like(x, np.float64)
    for i in range(rows):
        for c in range(hidden):
            for t in range(taps):
                if i % block_size >= t:
                    out[i, c] += (base[t, c] + delta[i, t, c // (hidden // groups)]) * x[i - t, c]
    return out


@pytest.mark.parametrize("taps", [1, 2, 3])
def test_block_convolution_is_its_formula_and_never_crosses_a_block(taps):
    rng = np.random.default_rng(taps)
    rows, hidden, groups, block = 12, 8, 4, 4
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    delta = rng.standard_normal((rows, taps, groups)).astype(np.float32)
    base = rng.standard_normal((taps, hidden)).astype(np.float32)
    out = block_convolution(jnp.asarray(x)[None], jnp.asarray(delta)[None], jnp.asarray(base), block)[0]
    np.testing.assert_allclose(out, loop_convolution(x, delta, base, block), rtol=1e-5, atol=1e-5)
    changed = x.copy()
    changed[4:8] += 1.0  # the second block only
    out_changed = block_convolution(jnp.asarray(changed)[None], jnp.asarray(delta)[None], jnp.asarray(base), block)[0]
    np.testing.assert_array_equal(out_changed[:4], out[:4])
    np.testing.assert_array_equal(out_changed[8:], out[8:])


def test_dflash2_drafter_equals_dflash_at_initialisation():
    """The same seed gives the same backbone (the convolutions draw no random numbers) and identity convolutions,
    so the outputs are equal exactly: in training's forward over packed rows and in a decoding step."""
    dflash_config = make_config((SLIDING, FULL), 5)
    dflash, dflash2 = (Drafter(c, rngs=nnx.Rngs(3)) for c in (dflash_config,
                                                                dataclasses.replace(dflash_config, **DFLASH2)))
    shared = dict(nnx.to_flat_state(nnx.state(dflash, nnx.Param)))
    extended = dict(nnx.to_flat_state(nnx.state(dflash2, nnx.Param)))
    assert set(shared) < set(extended)
    for path, variable in shared.items():
        np.testing.assert_array_equal(variable[...], extended[path][...], err_msg=str(path))
    assert {path[-2:] for path in set(extended) - set(shared)} >= {("attention_conv", "base_kernel"),
                                                                   ("kernel_projection", "kernel"),
                                                                   ("candidate_selector", "predecessor_codebook")}

    features, _, positions, segments = packed_rows(0, len(dflash_config.target_layer_ids))
    grid = AnchorGrid(SEQ_LEN, 2, BLOCK)
    embeds = jnp.asarray(np.random.default_rng(1).standard_normal((2, grid.num_queries, HIDDEN)), jnp.float32)
    hidden = [forward(d, jnp.asarray(features), embeds, positions, segments, grid) for d in (dflash, dflash2)]
    np.testing.assert_array_equal(hidden[1], hidden[0])

    @nnx.jit
    def decode(drafter, features, embeds):
        return drafter(features, embeds, DecodeStep(jnp.int32(0), jnp.int32(10)), drafter.init_cache(1, 16))[0]

    decoded = [decode(d, jnp.asarray(features[:1, :12]), embeds[:1, :BLOCK]) for d in (dflash, dflash2)]
    np.testing.assert_array_equal(decoded[1], decoded[0])


@pytest.mark.parametrize("fields, message", [
    (dict(DFLASH2, conv_group_size=12), "conv_group_size (12) must divide hidden_size (32)"),
    (dict(DFLASH2, conv_kernel_size=BLOCK + 1), f"conv_kernel_size ({BLOCK + 1}) must be at most block_size"),
    (dict(DFLASH2, selector_top_k=VOCAB + 1), f"selector_top_k ({VOCAB + 1}) must be at most vocab_size ({VOCAB})"),
    (dict(DFLASH2, selector_rank=0), "selector_rank must be a positive int for method 'dflash2', got 0"),
    (dict(selector_rank=4), "selector_rank=4 must be 0 for method 'dflash'"),
])
def test_dflash2_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config(**fields)


def test_training_candidates_put_a_missing_label_last():
    logits = jnp.asarray([[0.0, 5.0, 1.0, 4.0, 3.0, 2.0]] * 3)
    ids, contains = training_candidates(logits, jnp.asarray([3, 0, 2]), 3)
    np.testing.assert_array_equal(ids, [[1, 3, 4], [1, 3, 0], [1, 3, 2]])
    np.testing.assert_array_equal(contains, [True, False, False])


def test_greedy_walk_picks_each_slot_after_the_previous_pick():
    """The walk against a loop: slot k's candidates are its top-K, scored after the token slot k-1 took."""
    config = make_config(**DFLASH2)
    selector = Drafter(config, rngs=nnx.Rngs(0)).candidate_selector
    rng = np.random.default_rng(2)
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        codebook.set_value(jnp.asarray(rng.standard_normal(codebook.shape), jnp.float32))
    selector.hidden_projection.kernel.set_value(jnp.asarray(rng.standard_normal((HIDDEN, 8)), jnp.float32))
    hidden = rng.standard_normal((2, BLOCK - 1, HIDDEN)).astype(np.float32)
    log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.standard_normal((2, BLOCK - 1, VOCAB)) * 2), -1))
    anchors = np.array([7, 11])
    drafts = np.asarray(selector.greedy_walk(jnp.asarray(hidden), jnp.asarray(log_probs), jnp.asarray(anchors)))

    a, b = np.asarray(selector.predecessor_codebook[...]), np.asarray(selector.successor_codebook[...])
    w = np.asarray(selector.hidden_projection.kernel[...])
    for row in range(2):
        previous = anchors[row]
        for slot in range(BLOCK - 1):
            candidates = np.argsort(-log_probs[row, slot], kind="stable")[:5]
            scores = log_probs[row, slot, candidates] + (b[candidates] @ (a[previous] * (hidden[row, slot] @ w)))
            previous = candidates[np.argmax(scores)]
            assert drafts[row, slot] == previous, (row, slot)
    unary = np.argmax(log_probs, axis=-1)
    assert (drafts != unary).any()  # the transitions change picks, so the check above is not the unary argmax's
