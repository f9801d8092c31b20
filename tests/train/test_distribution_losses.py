"""The fused distribution losses (design §18) against an independent PyTorch reference of each term: values,
the TV kept for the confidence target, and the gradient w.r.t. the drafter's hidden state through autograd."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax.train.divergences import TERMS, lm_head_divergences

ROWS, HIDDEN, VOCAB = 7, 16, 50


def torch_terms(hidden, target_hidden, kernel, labels):
    """Each term per row from full logits, as speculators' eager losses define them."""
    log_q = torch.log_softmax(hidden @ kernel, dim=-1)
    log_p = torch.log_softmax(target_hidden @ kernel, dim=-1)
    q, p = log_q.exp(), log_p.exp()
    m = 0.5 * (p + q)
    return {
        "ce": -log_q.gather(-1, labels[:, None])[:, 0],
        "kl": (p * (log_p - log_q)).sum(-1),
        "rkl": (q * (log_q - log_p)).sum(-1),
        "jsd": 0.5 * (p * (log_p - m.log())).sum(-1) + 0.5 * (q * (log_q - m.log())).sum(-1),
        "tv": 0.5 * (p - q).abs().sum(-1),
    }


@pytest.mark.parametrize("terms", [(("kl", 1.0),), (("rkl", 1.0),), (("jsd", 1.0),), (("tv", 1.0),),
                                   (("ce", 0.1), ("tv", 0.9)), tuple((name, 0.5 + i) for i, name in enumerate(TERMS))])
def test_each_term_and_its_gradient_match_autograd(terms):
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    target_hidden = rng.normal(size=(ROWS, HIDDEN)).astype(np.float32)
    kernel = (rng.normal(size=(HIDDEN, VOCAB)) * 0.5).astype(np.float32)
    labels = rng.integers(0, VOCAB, size=ROWS)
    row_weights = rng.uniform(size=ROWS).astype(np.float32)  # stands for mask x position weight

    h = torch.tensor(hidden, dtype=torch.float64, requires_grad=True)
    reference = torch_terms(h, torch.tensor(target_hidden, dtype=torch.float64),
                            torch.tensor(kernel, dtype=torch.float64), torch.tensor(labels))
    total = sum(weight * reference[name] for name, weight in terms)
    (total * torch.tensor(row_weights, dtype=torch.float64)).sum().backward()

    def loss(x):
        value, tv, _ = lm_head_divergences(x, jnp.asarray(target_hidden), jnp.asarray(kernel),
                                           jnp.asarray(labels), terms, row_chunk=3)  # 3 chunks, the last padded
        return jnp.sum(value * row_weights), (value, tv)

    (_, (value, tv)), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(hidden))
    np.testing.assert_allclose(value, total.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tv, reference["tv"].detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, h.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_identical_distributions_have_zero_divergence_and_no_gradient():
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(ROWS, HIDDEN)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(HIDDEN, VOCAB)), jnp.float32)
    terms = (("kl", 1.0), ("rkl", 1.0), ("jsd", 1.0), ("tv", 1.0))
    value, tv, _ = lm_head_divergences(hidden, hidden, kernel, jnp.zeros(ROWS, jnp.int32), terms, row_chunk=4)
    grad = jax.grad(lambda x: jnp.sum(lm_head_divergences(x, hidden, kernel, jnp.zeros(ROWS, jnp.int32), terms,
                                                          row_chunk=4)[0]))(hidden)
    np.testing.assert_allclose(value, 0.0, atol=1e-5)
    np.testing.assert_allclose(tv, 0.0, atol=1e-6)
    np.testing.assert_allclose(grad, 0.0, atol=1e-4)


def test_an_unknown_term_is_refused():
    x = jnp.zeros((2, HIDDEN))
    with pytest.raises(ValueError, match=r"unknown loss terms \['nla'\]"):
        lm_head_divergences(x, x, jnp.zeros((HIDDEN, VOCAB)), jnp.zeros(2, jnp.int32), (("nla", 1.0),), 2)
