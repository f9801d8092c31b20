"""DFlash2's selector loss (design §18.4): the K-way cross-entropy of the candidate selector's scores against
the hard label, teacher-forced on the data's previous tokens.

Per drafted slot k of the block at anchor a: the candidates are the top-K tokens of the unary logits z_k with the
label (the target's greedy token) in place of the K-th where it is missing (`dflash2.training_candidates`, taken
in the fused LM-head loss's own row chunks, so no [rows, V] array exists), the predecessor is the data's token at
a+k−1 (the anchor's own for slot 1), and
    ce_k = logsumexp_c s(c | x_{a+k−1}, h_k) − s(label | x_{a+k−1}, h_k),
    s(c | a, h) = z_k[c] + ⟨A[a] ⊙ W_h h, Bc[c]⟩.
Gradients reach h_k through both the unary scores (each row's K columns of the frozen LM head) and W_h, and the
selector's three weights. The step weighs the slots as the unary loss (the fixed decay, or D-PACE from this CE)
and adds the sum with weight `drafter.selector_alpha`, speculators 0.9.0's `selector_loss_alpha`
(`models/dflash2/metrics.py`, whose formulas these are).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models.dflash2 import CandidateSelector
from dflash_jax.train.loss import rematerialised_chunks


def candidate_logits(hidden: jax.Array, lm_head_kernel: jax.Array, candidate_ids: jax.Array,
                     row_chunk: int) -> jax.Array:
    """[..., R, K]: hidden [..., R, H] times each row's K candidate columns of the LM head [H, V] (frozen: no
    gradient into it), in the head's dtype with fp32 accumulation as the fused loss's logits. Row chunks are
    rematerialised, so the gathered [c, K, H] columns exist for one chunk at a time, also in the backward."""
    kernel = jax.lax.stop_gradient(lm_head_kernel)

    def chunk(h, ids):
        columns = jnp.take(kernel, ids.reshape(-1), axis=1).T.reshape(*ids.shape, kernel.shape[0])  # [..., c, K, H]
        return jnp.einsum("...h,...kh->...k", h.astype(kernel.dtype), columns, preferred_element_type=jnp.float32)

    return rematerialised_chunks(chunk, row_chunk, hidden.ndim - 2, hidden, candidate_ids)


def selector_cross_entropy(selector: CandidateSelector, hidden: jax.Array, lm_head_kernel: jax.Array,
                           candidates: tuple[jax.Array, jax.Array], predecessor_ids: jax.Array, labels: jax.Array,
                           row_chunk: int) -> tuple[jax.Array, jax.Array]:
    """Per drafted slot: (the K-way cross-entropy [..., R] fp32, whether the selector's pick is the label and
    the label was among the unary top-K, as decoding would find it [..., R]).

    hidden [..., R, H]: the drafter's final-normed hidden states of the drafted slots; candidates: (ids [..., R,
    K], contains [..., R]) from the fused loss; predecessor_ids, labels [..., R]."""
    candidate_ids, contains = candidates
    scores = selector.scores(hidden, predecessor_ids, candidate_ids,
                             candidate_logits(hidden, lm_head_kernel, candidate_ids, row_chunk))
    label_position = jnp.argmax(candidate_ids == labels[..., None], axis=-1)  # first match; K-1 if injected
    label_score = jnp.take_along_axis(scores, label_position[..., None], axis=-1)[..., 0]
    ce = jax.nn.logsumexp(scores, axis=-1) - label_score
    correct = (jnp.argmax(scores, axis=-1) == label_position) & contains
    return ce, correct
