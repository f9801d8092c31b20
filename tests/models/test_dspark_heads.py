"""DSpark's Markov bias, confidence head and confidence loss against an independent NumPy reference of the
formulas (speculators 0.9.0 DSpark, design §18)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.dspark_heads import ConfidenceHead, MarkovHead
from dflash_jax.train.confidence import confidence_loss

V_VERIFIER, V_DRAFT, RANK, HIDDEN, SLOTS = 40, 24, 8, 16, 12


def test_markov_bias_and_confidence_logits_match_numpy():
    markov = MarkovHead(V_VERIFIER, V_DRAFT, RANK, rngs=nnx.Rngs(0))
    confidence = ConfidenceHead(HIDDEN, RANK, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    prev = rng.integers(0, V_VERIFIER, (2, SLOTS))
    hidden = rng.standard_normal((2, SLOTS, HIDDEN)).astype(np.float32)
    w1, w2 = np.asarray(markov.w1[...]), np.asarray(markov.w2[...])
    e = markov.prev_embeddings(jnp.asarray(prev))
    np.testing.assert_allclose(np.asarray(e), w1[prev], rtol=0, atol=0)
    expected_bias = np.einsum("bkr,rv->bkv", w1[prev], w2)
    np.testing.assert_allclose(np.asarray(markov.logit_bias(jnp.asarray(prev), jnp.float32)), expected_bias,
                               rtol=1e-5, atol=1e-6)
    features = np.concatenate([hidden, w1[prev]], axis=-1)
    expected_conf = features @ np.asarray(confidence.kernel[...])[:, 0] + np.asarray(confidence.bias[...])[0]
    np.testing.assert_allclose(np.asarray(confidence(jnp.asarray(hidden), e)), expected_conf, rtol=1e-5, atol=1e-6)
    # Initialisation: W1 ~ N(0, 0.01); W2 within PyTorch's default Linear bound 1/sqrt(r).
    assert 0.005 < w1.std() < 0.015 and np.abs(w2).max() <= 1 / np.sqrt(RANK)


def test_confidence_loss_matches_numpy_and_detaches_the_target():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 8)).astype(np.float32) * 3
    tv = rng.uniform(0, 1, (3, 8)).astype(np.float32)
    mask = (rng.uniform(size=(3, 8)) > 0.3).astype(np.float32)
    decay = np.broadcast_to(np.exp(-np.arange(8) / 4.0), (3, 8)).astype(np.float32)
    a = 1 - tv
    sigma = 1 / (1 + np.exp(-logits.astype(np.float64)))
    bce = -(a * np.log(sigma) + (1 - a) * np.log1p(-sigma))
    expected = (bce * mask * decay).sum() / (mask.sum() + 1e-8)
    got = confidence_loss(jnp.asarray(logits), jnp.asarray(tv), jnp.asarray(mask), jnp.asarray(decay))
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)
    d_logits, d_tv = jax.grad(confidence_loss, argnums=(0, 1))(jnp.asarray(logits), jnp.asarray(tv),
                                                               jnp.asarray(mask), jnp.asarray(decay))
    np.testing.assert_allclose(np.asarray(d_logits), (sigma - a) * mask * decay / (mask.sum() + 1e-8),
                               rtol=1e-4, atol=1e-7)
    assert not np.asarray(d_tv).any()  # the target 1 − TV is detached
