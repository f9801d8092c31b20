"""The position-weighted hard cross-entropy and its metrics (design §6), computed in chunks.

Nothing here materialises [rows, V] logits for all rows at once: the drafter's LM head + cross-entropy walk
row chunks under `jax.checkpoint`, so the backward pass recomputes one chunk's logits at a time. (The
target's greedy labels: ops/lm_head.py.)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """w_0 = 0 and w_k = exp(-(k-1)/gamma) for k >= 1 (DFlash position decay; design §6)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = np.arange(block_size, dtype=np.float64)
    return np.where(k >= 1, np.exp(-(k - 1) / gamma), 0.0).astype(np.float32)


def chunked_cross_entropy(hidden: jax.Array, lm_head_kernel: jax.Array, labels: jax.Array, row_chunk: int
                          ) -> tuple[jax.Array, jax.Array]:
    """Per-row cross-entropy and correctness of argmax for logits = hidden @ lm_head_kernel.

    hidden: [..., R, H]; labels: [..., R]. The R axis is walked in chunks of `row_chunk` (padded up to a
    multiple); leading (batch) axes stay whole, so a batch sharded over devices stays sharded and each device
    holds [local batch, row_chunk, V] logits at a time, inside a rematerialised scan step (the backward
    recomputes them). Returns (ce [..., R] fp32, correct [..., R] bool).
    """
    *lead, rows, width = hidden.shape
    chunk = min(row_chunk, rows)
    padded = -(-rows // chunk) * chunk
    row_padding = [(0, 0)] * len(lead) + [(0, padded - rows)]
    # [..., R, H] -> [R/chunk, ..., chunk, H]: the scan walks the leading axis.
    hidden_chunks = jnp.moveaxis(jnp.pad(hidden, row_padding + [(0, 0)]).reshape(*lead, -1, chunk, width), -3, 0)
    label_chunks = jnp.moveaxis(jnp.pad(labels, row_padding).reshape(*lead, -1, chunk), -2, 0)

    @jax.checkpoint
    def one_chunk(h, y):
        logits = jnp.dot(h, lm_head_kernel.astype(h.dtype), preferred_element_type=jnp.float32)
        label_logit = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        ce = jax.nn.logsumexp(logits, axis=-1) - label_logit
        correct = jnp.argmax(logits, axis=-1) == y
        return ce, correct

    def body(_, chunk_inputs):
        return None, one_chunk(*chunk_inputs)

    _, (ce, correct) = jax.lax.scan(body, None, (hidden_chunks, label_chunks))

    def unchunk(x):
        return jnp.moveaxis(x, 0, -2).reshape(*lead, padded)[..., :rows]

    return unchunk(ce), unchunk(correct)


class LossOutput(NamedTuple):
    loss: jax.Array  # scalar: Σ w_k·CE·m / Σ m
    slot_correct: jax.Array  # [B] number of trained slots at position k whose argmax equals the label
    slot_count: jax.Array  # [B] number of trained slots at position k


def dflash_loss(ce: jax.Array, correct: jax.Array, slot_mask: jax.Array, weights: jax.Array,
                normaliser: jax.Array | None = None) -> LossOutput:
    """design §6 loss over trained slots. ce, correct, slot_mask: [batch, N, B]; weights: [B] with w_0 = 0.

    The normaliser is the number of trained slots (speculators' convention), not the weight sum. Pass the
    whole batch's count as `normaliser` when this is one micro-batch of it: the micro-batch losses then
    add up to the whole batch's loss (and their gradients to its gradient).
    """
    mask = slot_mask.astype(jnp.float32)
    if normaliser is None:
        normaliser = trained_slot_count(slot_mask)
    loss = jnp.sum(ce * weights * mask) / normaliser
    slot_correct = jnp.sum(correct.astype(jnp.float32) * mask, axis=(0, 1))
    slot_count = jnp.sum(mask, axis=(0, 1))
    return LossOutput(loss, slot_correct, slot_count)


def trained_slot_count(slot_mask: jax.Array) -> jax.Array:
    """Σ m, at least 1 (a batch without trained slots has loss 0, not NaN)."""
    return jnp.maximum(jnp.sum(slot_mask.astype(jnp.float32)), 1.0)


def acceptance_metrics(slot_correct: np.ndarray, slot_count: np.ndarray) -> dict[str, float]:
    """Per-slot accuracy acc_k (k >= 1), EAL = Σ_k Π_{i<=k} acc_i and τ_est = 1 + EAL (design §6)."""
    slot_correct, slot_count = np.asarray(slot_correct, np.float64), np.asarray(slot_count, np.float64)
    accuracy = np.where(slot_count > 0, slot_correct / np.maximum(slot_count, 1.0), 0.0)[1:]
    eal = float(np.sum(np.cumprod(accuracy)))
    metrics = {f"acc_{k}": float(a) for k, a in enumerate(accuracy, start=1)}
    metrics.update(eal=eal, tau_est=1.0 + eal)
    return metrics
