"""DSpark's confidence loss (design §18): binary cross-entropy of the confidence head's logit c_t against the
detached acceptance rate α_t = 1 − TV_t = Σ_v min(p_v, q_v) of the Markov-corrected draft distribution,
L_conf = Σ_t m_t·d_t·BCE(c_t, sg(α_t)) / (Σ_t m_t + 1e-8), always with the fixed exponential position decay d
(speculators 0.9.0 `models/dspark/metrics.py`: its denominator is Σ m, not Σ m·d)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

CONFIDENCE_EPS = 1e-8


def bce_with_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """−[y·log σ(c) + (1−y)·log(1−σ(c))] in the overflow-free form max(c, 0) − c·y + log(1 + e^−|c|)."""
    return jnp.maximum(logits, 0.0) - logits * targets + jnp.log1p(jnp.exp(-jnp.abs(logits)))


def confidence_loss(confidence_logits: jax.Array, total_variation: jax.Array, mask: jax.Array,
                    decay: jax.Array, normaliser: jax.Array | None = None) -> jax.Array:
    """confidence_logits, total_variation (per slot, detached here), mask, decay: same shape -> scalar.

    normaliser: the denominator instead of Σ m + 1e-8, for one micro-batch of a batch: the whole batch's trained
    slot count (the train step's, as for the token terms), so the micro-batches' losses add up to the batch's."""
    accept_rate = jax.lax.stop_gradient(1.0 - total_variation.astype(jnp.float32))
    mask = mask.astype(jnp.float32)
    per_slot = bce_with_logits(confidence_logits.astype(jnp.float32), accept_rate)
    if normaliser is None:
        normaliser = jnp.sum(mask) + CONFIDENCE_EPS
    return jnp.sum(per_slot * mask * decay) / normaliser
