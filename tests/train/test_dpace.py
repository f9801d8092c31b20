"""D-PACE position weights (design §6) against a PyTorch transcription of vLLM speculators' `dpace_loss_decay`
and a plain NumPy loop over the formula; the gradient of the D-PACE loss against a finite difference with the
weights held constant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax.train.loss import dflash_loss, dpace_weights, lm_head_cross_entropy
from tests.train_fixtures import loop_dpace


def speculators_dpace(elementwise_loss: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                      alpha: float) -> torch.Tensor:
    """speculators/losses/utils.py `dpace_loss_decay`, restated in torch for a [1, N*B] packed sequence: the
    masked CE (its `loss_function` multiplies by the mask first), q = exp(-CE), smoothed where trained and 1
    elsewhere, a prefix product per block, then a flipped cumulative sum of the trained prefix products."""
    with torch.no_grad():
        q = torch.exp(-(elementwise_loss * loss_mask)).float().reshape(-1, block_size)
        mask = loss_mask.reshape(-1, block_size).to(q.dtype)
        smooth = torch.where(mask > 0, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        prefix = torch.cumprod(smooth, dim=-1)
        suffix = torch.flip(torch.cumsum(torch.flip(prefix * mask, dims=[-1]), dim=-1), dims=[-1])
        return (suffix * mask).reshape(1, -1)


def random_blocks(seed: int, shape=(3, 5, 8)):
    rng = np.random.default_rng(seed)
    ce = rng.exponential(1.5, shape).astype(np.float32)
    mask = rng.random(shape) < 0.75
    mask[..., 0] = False  # the anchor slot is never trained
    mask[0, 0] = False  # a block with nothing trained
    mask[1, 1, 3:] = False  # a block cut short by its document's end
    return ce, mask


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 1.0])
def test_weights_equal_speculators_and_the_formula(alpha):
    ce, mask = random_blocks(seed=int(alpha * 4))
    weights = np.asarray(jax.jit(dpace_weights, static_argnums=2)(jnp.asarray(ce), jnp.asarray(mask), alpha))
    block = ce.shape[-1]
    reference = speculators_dpace(torch.from_numpy(ce).reshape(1, -1), torch.from_numpy(mask).reshape(1, -1).long(),
                                  block, alpha).reshape(ce.shape).numpy()
    np.testing.assert_allclose(weights, reference, rtol=1e-6)
    np.testing.assert_allclose(weights, loop_dpace(ce, mask, alpha), rtol=1e-5)
    assert np.all(weights[~mask] == 0) and np.all(weights[mask] > 0)
    if alpha == 1.0:  # no confidence term left: the weight counts the trained slots from j to the block's end
        np.testing.assert_array_equal(weights, np.where(mask, np.cumsum(mask[..., ::-1], -1)[..., ::-1], 0))


def test_gradient_is_a_finite_difference_through_constant_weights():
    """d loss / d hidden of the D-PACE loss equals the central difference of Σ w·CE·m / Σ m in float64 with w
    fixed at the point of differentiation, and differs from the one that lets w move with the hidden state."""
    rng = np.random.default_rng(0)
    batch, blocks, block, width, vocab, alpha = 2, 3, 4, 8, 24, 0.5
    hidden = rng.normal(size=(batch, blocks * block, width)).astype(np.float32)
    kernel = (rng.normal(size=(width, vocab)) / np.sqrt(width)).astype(np.float32)
    labels = rng.integers(0, vocab, (batch, blocks * block)).astype(np.int32)
    mask = rng.random((batch, blocks, block)) < 0.8
    mask[..., 0] = False

    def loss(h):
        ce, correct = lm_head_cross_entropy(h, jnp.asarray(kernel), jnp.asarray(labels), 5)
        ce, correct = ce.reshape(mask.shape), correct.reshape(mask.shape)
        return dflash_loss(ce, correct, jnp.asarray(mask), dpace_weights(ce, jnp.asarray(mask), alpha)).loss

    grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(hidden)), np.float64)

    def numpy_ce(h):
        logits = (h @ kernel.astype(np.float64)).reshape(batch, blocks, block, vocab)
        top = logits.max(-1, keepdims=True)
        logsumexp = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        return logsumexp - np.take_along_axis(logits, labels.reshape(mask.shape)[..., None], -1)[..., 0]

    fixed = loop_dpace(numpy_ce(hidden.astype(np.float64)), mask, alpha)

    def numpy_loss(h, weights=None):
        ce = numpy_ce(h)
        weights = loop_dpace(ce, mask, alpha) if weights is None else weights
        return np.sum(weights * ce * mask) / mask.sum()

    direction = rng.normal(size=hidden.shape)
    step = 1e-4
    point = hidden.astype(np.float64)
    constant = (numpy_loss(point + step * direction, fixed) - numpy_loss(point - step * direction, fixed)) / (2 * step)
    moving = (numpy_loss(point + step * direction) - numpy_loss(point - step * direction)) / (2 * step)
    analytic = float(np.sum(grad * direction))
    np.testing.assert_allclose(analytic, constant, rtol=1e-4)
    assert abs(moving - constant) > 100 * abs(analytic - constant)  # the test tells the two apart
    np.testing.assert_allclose(float(jax.jit(loss)(jnp.asarray(hidden))), numpy_loss(point), rtol=1e-5)
