"""Distribution losses between the drafter's and the target's next-token distributions (design §18), computed
in row chunks with the gradient fused into the forward pass, as the hard cross-entropy of train/loss.py.

q = softmax(hidden @ W) is the drafter's, p = softmax(target_hidden @ W) the target's (its final-normed last
hidden state through its own LM head W, frozen). Per row, the terms of vLLM speculators'
`losses/eager.py` (its formulas, re-derived here):
  ce  = -log q[y]                     (y: the hard label)
  kl  = Σ p (log p - log q)           (forward KL)
  rkl = Σ q (log q - log p)
  jsd = ½ KL(p‖m) + ½ KL(q‖m), m = (p + q)/2
  tv  = 1 - Σ min(p, q) = ½ ‖p - q‖₁
Their gradients w.r.t. the drafter's logits z (p is a constant): ce: q - onehot(y); kl: q - p; for the others,
with g = dℓ/dq, dℓ/dz = q ⊙ (g - Σ q g): rkl g = log q - log p (+1, which cancels), jsd g = ½ log(q/m),
tv g = -[q < p].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax.models.dflash2 import training_candidates
from dflash_jax.train.loss import back_through_head, draft_logits, label_is_argmax, lm_head_pass

TERMS = ("ce", "kl", "rkl", "jsd", "tv")


def lm_head_divergences(hidden: jax.Array, target_hidden: jax.Array, lm_head_kernel: jax.Array, labels: jax.Array,
                        terms: tuple[tuple[str, float], ...], row_chunk: int,
                        markov: tuple[jax.Array, jax.Array] | None = None, top_k: int = 0) -> tuple[jax.Array, ...]:
    """Per row, the weighted sum Σ weight·term over `terms` ((name, weight) pairs of TERMS), the TV (for the
    confidence target; it carries no gradient) and whether the label is the drafter's argmax.

    hidden, target_hidden: [..., R, H]; lm_head_kernel: [H, V]; labels: [..., R] int. Neither side's [R, V]
    logits exist at once beyond one chunk of `row_chunk` rows; the forward keeps d(sum)/d hidden ([..., R, H])
    as the only residual, so the backward computes no logits. Only `hidden` gets a gradient.

    markov = (e [..., R, r], W2 [r, V]): DSpark's Markov bias e @ W2 is added to the drafter's logits of each
    row chunk (design §18); hidden, e and W2 then get their gradients by `rematerialised_chunks`.
    top_k > 0 (DFlash2): also the selector's candidates of each row, as `lm_head_cross_entropy` gives them.
    """
    unknown = [name for name, _ in terms if name not in TERMS]
    if unknown:
        raise ValueError(f"unknown loss terms {unknown}; known: {TERMS}")
    kernel = jax.lax.stop_gradient(lm_head_kernel)
    target_hidden, terms = jax.lax.stop_gradient(target_hidden), tuple(terms)
    statistics = functools.partial(_chunk_statistics, terms=terms, top_k=top_k)
    return lm_head_pass(statistics, row_chunk, hidden, kernel, (target_hidden, labels), markov, top_k)


def _chunk_statistics(h, kernel, th, y, terms, with_gradient, markov=None, top_k=0):
    z = draft_logits(h, kernel, markov)
    t = jnp.dot(th.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    log_q = jax.nn.log_softmax(z, axis=-1)
    log_p = jax.nn.log_softmax(t, axis=-1)
    q, p = jnp.exp(log_q), jnp.exp(log_p)
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    onehot = (vocab_ids == y[..., None]).astype(jnp.float32)
    log_m = jnp.log(0.5 * (p + q))
    tv = 1.0 - jnp.sum(jnp.minimum(p, q), axis=-1)
    values = {
        "ce": -jnp.sum(onehot * log_q, axis=-1),
        "kl": jnp.sum(p * (log_p - log_q), axis=-1),
        "rkl": jnp.sum(q * (log_q - log_p), axis=-1),
        "jsd": 0.5 * jnp.sum(p * (log_p - log_m) + q * (log_q - log_m), axis=-1),
        "tv": tv,
    }
    total = sum(weight * values[name] for name, weight in terms)
    outputs = (total, jax.lax.stop_gradient(tv), label_is_argmax(z, y, vocab_ids))  # tv: the confidence target
    outputs += training_candidates(z, y, top_k) if top_k else ()
    if not with_gradient:
        return outputs

    def through_softmax(g):  # dℓ/dz from dℓ/dq
        return q * (g - jnp.sum(q * g, axis=-1, keepdims=True))

    gradients = {
        "ce": lambda: q - onehot,
        "kl": lambda: q - p,
        "rkl": lambda: through_softmax(log_q - log_p),
        "jsd": lambda: through_softmax(0.5 * (log_q - log_m)),
        "tv": lambda: through_softmax(-(q < p).astype(jnp.float32)),
    }
    grad_z = sum(weight * gradients[name]() for name, weight in terms)
    return outputs + (back_through_head(grad_z, kernel, h.dtype),)
