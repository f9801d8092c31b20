"""The position-weighted hard cross-entropy and its metrics (design §6), computed in chunks.

Nothing here materialises [rows, V] logits for all rows at once: the drafter's LM head + cross-entropy walk
row chunks whose forward pass also computes the gradient w.r.t. the drafter's hidden state, so the backward
pass computes no logits at all. (The target's greedy labels: ops/lm_head.py.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.dflash2 import training_candidates
from dflash_jax.sharding import ROWS, ROWS_EMBED, ROWS_VOCAB, SHARD_ROWS_VOCAB, constrain


def position_weights(block_size: int, gamma: float, from_anchor: bool = False) -> np.ndarray:
    """w_0 = 0 and w_k = exp(-(k-1)/gamma) for k >= 1 (DFlash position decay; design §6); with `from_anchor`
    (DSpark, every slot drafted, design §18) w_k = exp(-k/gamma) for every k."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    first = 0 if from_anchor else 1
    k = np.arange(block_size, dtype=np.float64)
    return np.where(k >= first, np.exp(-(k - first) / gamma), 0.0).astype(np.float32)


def dpace_weights(ce: jax.Array, slot_mask: jax.Array, alpha: float) -> jax.Array:
    """D-PACE position weights (design §6): per block, the expected number of accepted slots each slot gates.

    ce, slot_mask: [..., B] (the last axis is one block's slots). The drafter's confidence in slot i is
    q_i = exp(-CE_i), smoothed to s_i = (1 - alpha) q_i + alpha; an untrained slot has s_i = 1 (it never
    breaks the chain) and adds nothing to a sum. The weight of trained slot j is Σ_{m >= j, trained} Π_{i <= m} s_i
    (0 for an untrained slot). This is `dpace_loss_decay` of vLLM's speculators (speculators/losses/utils.py,
    `--per-position-loss-weight dpace`), here from the CE the fused LM-head pass already computed, so it
    costs no pass over the vocabulary. The weights are constants of the loss: no gradient flows through them.
    """
    ce = jax.lax.stop_gradient(ce).astype(jnp.float32)
    trained = slot_mask.astype(jnp.float32)
    smoothed = jnp.where(trained > 0, (1.0 - alpha) * jnp.exp(-ce) + alpha, 1.0)
    prefix = jnp.cumprod(smoothed, axis=-1)
    return jax.lax.cumsum(prefix * trained, axis=ce.ndim - 1, reverse=True) * trained


def map_row_chunks(fn: Callable, row_chunk: int, axis: int, *arrays: jax.Array):
    """fn applied to successive chunks of `row_chunk` rows of `arrays` along `axis`, outputs joined along it.

    The axes before `axis` (batch axes) stay whole, so a batch sharded over devices stays sharded and each
    device works on [local batch, row_chunk, ...] at a time. The last chunk is padded with zero rows (their
    outputs are dropped). A `fori_loop` writes each chunk's outputs in place: no transposes, one chunk live.
    Rows that fit in one chunk are one call of fn.
    """
    rows = arrays[0].shape[axis]
    chunk = min(row_chunk, rows)
    count = -(-rows // chunk)
    if count == 1:  # all rows in one chunk: no loop, no output buffers to write into
        return fn(*arrays)
    padding = [(0, 0)] * axis + [(0, count * chunk - rows)]
    arrays = [jnp.pad(x, padding + [(0, 0)] * (x.ndim - axis - 1)) if count * chunk > rows else x for x in arrays]

    def inputs_of(i):
        return [jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis) for x in arrays]

    def write(i, outputs):
        return jax.tree.map(lambda out, new: jax.lax.dynamic_update_slice_in_dim(out, new, i * chunk, axis),
                            outputs, fn(*inputs_of(i)))

    first = jax.eval_shape(fn, *inputs_of(0))
    outputs = jax.tree.map(lambda s: jnp.zeros(s.shape[:axis] + (count * chunk,) + s.shape[axis + 1:], s.dtype),
                           first)
    outputs = jax.lax.fori_loop(0, count, write, outputs)
    return jax.tree.map(lambda out: jax.lax.slice_in_dim(out, 0, rows, axis=axis), outputs)


def draft_logits(h: jax.Array, kernel: jax.Array, markov: tuple[jax.Array, jax.Array] | None) -> jax.Array:
    """One row chunk's draft logits h @ kernel in fp32, plus DSpark's Markov bias e @ W2 when `markov` = (e
    [..., c, r], W2 [r, V]) is given (design §18): the bias exists for the chunk's rows only."""
    # Both products run in the weights' dtype with fp32 accumulation: a bf16 head is never copied to fp32
    # (its [H, V] copy would be the step's largest temporary, and an fp32 dot runs at a fraction of the bf16 rate).
    logits = jnp.dot(h.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    if markov is not None:
        prev_embeddings, w2 = markov
        logits = logits + jnp.dot(prev_embeddings.astype(w2.dtype), w2, preferred_element_type=jnp.float32)
    return logits


def rematerialised_chunks(chunk: Callable, row_chunk: int, axis: int, *arrays: jax.Array):
    """`map_row_chunks` of `chunk` differentiated by autodiff with each chunk rematerialised (DSpark's path,
    design §18): the forward keeps only the chunks' inputs, and the backward recomputes each chunk's logits to
    take its gradient, into the trainable W2 too, whose gradient Σ_rows e·dℓ/dz needs the incoming per-row
    cotangents and so cannot be fused into the forward as the hidden states' is."""
    return map_row_chunks(jax.checkpoint(chunk), row_chunk, axis, *arrays)


def lm_head_cross_entropy(hidden: jax.Array, lm_head_kernel: jax.Array, labels: jax.Array, row_chunk: int,
                          markov: tuple[jax.Array, jax.Array] | None = None, top_k: int = 0) -> tuple[jax.Array, ...]:
    """Per-row cross-entropy of logits = hidden @ lm_head_kernel against `labels`, and whether the label is
    the logits' argmax. hidden: [..., R, H]; lm_head_kernel: [H, V]; labels: [..., R] int.

    Returns (ce [..., R] fp32, correct [..., R] bool). The LM head is the frozen target's: no gradient flows
    into it (stopped here, explicitly). The gradient w.r.t. `hidden` is fused into the forward pass: each
    chunk of `row_chunk` rows computes its [..., row_chunk, V] logits once and, under differentiation, also
    d ce / d hidden = (softmax(logits) - onehot(label)) @ lm_head_kernelᵀ, kept as the only residual ([..., R, H],
    hidden's size); the backward pass scales it by the incoming cotangent and recomputes no logits. The full
    [..., R, V] logits never exist. `correct` compares the label's logit with the row maximum (no argmax):
    it holds iff the label attains the maximum and no lower id does, i.e. exactly argmax(logits) == label
    with ties resolved to the lowest id, as `jnp.argmax` and `ops.lm_head.greedy_labels` resolve them.

    markov = (e [..., R, r], W2 [r, V]): DSpark's Markov bias e @ W2 is added to each row chunk's logits (design
    §18); both get gradients, by `rematerialised_chunks` instead of the fused gradient.

    top_k > 0 (DFlash2, design §18.4): also each row's selector candidates from the same logits,
    (ids [..., R, K], whether the label is among the top-K [..., R]) of `dflash2.training_candidates`; integers,
    no gradient.
    """
    if hidden.ndim == 3:  # [b, R, H]: rows stay split over the batch axes under a mesh (design §13)
        hidden, labels = constrain(hidden, ROWS_EMBED), constrain(labels, ROWS)
    statistics = functools.partial(_logit_statistics, top_k=top_k)
    return lm_head_pass(statistics, row_chunk, hidden, jax.lax.stop_gradient(lm_head_kernel), (labels,), markov,
                        top_k)


def lm_head_pass(statistics: Callable, row_chunk: int, hidden: jax.Array, kernel: jax.Array,
                 others: tuple[jax.Array, ...], markov: tuple[jax.Array, jax.Array] | None, top_k: int):
    """The one LM-head pass of the hard cross-entropy and the distribution terms: `statistics(h, kernel, *others,
    with_gradient, markov)` of each row chunk, its first output differentiable, its d first / d h fused into the
    forward without a Markov bias; with one (DSpark, design §18), `rematerialised_chunks` instead."""
    if markov is None:
        return _fused_chunks(statistics, row_chunk, hidden, kernel, others)
    if top_k:
        raise ValueError("the selector's candidates (top_k) come without a Markov bias (no method has both)")
    prev_embeddings, w2 = markov

    def chunk(h, *rest):
        *chunk_others, e = rest
        return statistics(h, kernel, *chunk_others, with_gradient=False, markov=(e, w2))

    return rematerialised_chunks(chunk, row_chunk, hidden.ndim - 2, hidden, *others, prev_embeddings)


def label_is_argmax(logits: jax.Array, y: jax.Array, vocab_ids: jax.Array) -> jax.Array:
    """Whether label y is argmax(logits) with ties to the lowest id (as `jnp.argmax`), without an argmax: the
    label attains the row maximum and no lower id does. logits: [..., c, V]; y: [..., c]."""
    label_logit = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
    lower_max = jnp.max(jnp.where(vocab_ids < y[..., None], logits, -jnp.inf), axis=-1)
    return (label_logit >= jnp.max(logits, axis=-1)) & (lower_max < label_logit)


def _logit_statistics(h: jax.Array, kernel: jax.Array, y: jax.Array, with_gradient: bool,
                      markov: tuple[jax.Array, jax.Array] | None = None, top_k: int = 0):
    """One row chunk: (ce, correct), the selector's candidates if top_k, and, if with_gradient, d ce / d h.
    h: [..., c, H]; y: [..., c]."""
    logits = draft_logits(h, kernel, markov)
    if logits.ndim in (3, 4):  # [b, c, V] or a context-split row's [b, C, c, V]: the vocabulary over `tensor`
        logits = constrain(logits, ROWS_VOCAB if logits.ndim == 3 else SHARD_ROWS_VOCAB)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    label_logit = jnp.take_along_axis(logits, y[..., None], axis=-1)
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    exp = jnp.exp(logits - row_max)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    ce = jnp.log(total) + row_max - label_logit  # logsumexp(logits) - logits[label]
    outputs = (ce[..., 0], label_is_argmax(logits, y, vocab_ids))
    outputs += training_candidates(logits, y, top_k) if top_k else ()
    if not with_gradient:
        return outputs
    # d ce / d logits = softmax(logits) - onehot(label), in fp32 like the logits; then back through the head.
    grad_logits = exp / total - (vocab_ids == y[..., None]).astype(jnp.float32)
    return outputs + (back_through_head(grad_logits, kernel, h.dtype),)


def back_through_head(grad_logits: jax.Array, kernel: jax.Array, dtype) -> jax.Array:
    """d loss / d h from d loss / d logits: contracting V (the logits' grad @ kernel transposed, as autodiff of
    the head's dot would), accumulated in fp32 and returned in the hidden states' dtype."""
    return jax.lax.dot_general(grad_logits.astype(kernel.dtype), kernel, (((grad_logits.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_chunks(statistics, row_chunk, hidden, kernel, others):
    def chunk(h, *chunk_others):
        return statistics(h, kernel, *chunk_others, with_gradient=False)

    return map_row_chunks(chunk, row_chunk, hidden.ndim - 2, hidden, *others)


def _fused_chunks_forward(statistics, row_chunk, hidden, kernel, others):
    def chunk(h, *chunk_others):
        return statistics(h, kernel, *chunk_others, with_gradient=True)

    *outputs, grad_hidden = map_row_chunks(chunk, row_chunk, hidden.ndim - 2, hidden, *others)
    return tuple(outputs), (grad_hidden, tuple(None for _ in others))  # the others' count, not their arrays


def _fused_chunks_backward(statistics, row_chunk, residuals, cotangents):
    del statistics, row_chunk
    grad_hidden, no_other_gradients = residuals
    first_cotangent = cotangents[0]  # the other outputs are detached or integers: no cotangent
    hidden_cotangent = (first_cotangent[..., None] * grad_hidden.astype(jnp.float32)).astype(grad_hidden.dtype)
    # None: no gradient into the frozen LM head, the (stopped) target's hidden states or the integer labels
    return hidden_cotangent, None, no_other_gradients


_fused_chunks.defvjp(_fused_chunks_forward, _fused_chunks_backward)


class LossOutput(NamedTuple):
    loss: jax.Array  # scalar: Σ w·CE·m / Σ m
    slot_correct: jax.Array  # [B] number of trained slots at position k whose argmax equals the label
    slot_count: jax.Array  # [B] number of trained slots at position k


def dflash_loss(ce: jax.Array, correct: jax.Array, slot_mask: jax.Array, weights: jax.Array,
                normaliser: jax.Array | None = None) -> LossOutput:
    """design §6 loss over trained slots. ce, correct, slot_mask: [batch, N, B]; weights: [B] with w_0 = 0 (the
    fixed decay) or [batch, N, B] (D-PACE, `dpace_weights`).

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


def acceptance_metrics(slot_correct: np.ndarray, slot_count: np.ndarray, first_slot: int = 1) -> dict[str, float]:
    """Per-slot accuracy acc_k of the drafted slots k >= first_slot (1; 0 for DSpark, design §18),
    EAL = Σ_k Π_{i<=k} acc_i and τ_est = 1 + EAL (design §6)."""
    slot_correct, slot_count = np.asarray(slot_correct, np.float64), np.asarray(slot_count, np.float64)
    accuracy = np.where(slot_count > 0, slot_correct / np.maximum(slot_count, 1.0), 0.0)[first_slot:]
    eal = float(np.sum(np.cumprod(accuracy)))
    metrics = {f"acc_{k}": float(a) for k, a in enumerate(accuracy, start=first_slot)}
    metrics.update(eal=eal, tau_est=1.0 + eal)
    return metrics
