"""DSpark's two heads on top of the DFlash backbone (design §18): the low-rank Markov logit bias from the
previous token and the per-slot acceptance-confidence head.

Markov ("vanilla" variant): e_k = W1[prev_k] (W1 [V_verifier, r], indexed by the verifier-vocabulary id of the
token before slot k's label), bias_k = e_k @ W2 (W2 [r, V_draft]) added to slot k's draft logits.
Confidence: one logit per slot from [h_k ; e_k] (h_k the post-final-norm draft hidden state); its sigmoid is the
predicted acceptance probability 1 − TV(p_k, q_k).
Initialisation as speculators' DSpark: W1 ~ N(0, 0.01²); W2 and the confidence projection keep PyTorch's Linear
default, U(−1/√fan_in, 1/√fan_in), with the bias drawn from the same range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.layers import param

MARKOV_W1_STD = 0.01


def _linear_default_uniform(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    bound = 1.0 / fan_in ** 0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class MarkovHead(nnx.Module):
    """W1 [V_verifier, r] and W2 [r, V_draft] (JAX layout; speculators' `markov_w2.weight` is W2ᵀ)."""

    def __init__(self, verifier_vocab_size: int, draft_vocab_size: int, rank: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        w1 = jax.random.normal(rngs.params(), (verifier_vocab_size, rank), param_dtype) * MARKOV_W1_STD
        self.w1 = param(w1, ("vocab", "markov_rank"))
        w2 = _linear_default_uniform(rngs.params(), (rank, draft_vocab_size), rank, param_dtype)
        self.w2 = param(w2, ("markov_rank", "vocab"))

    def prev_embeddings(self, prev_ids: jax.Array) -> jax.Array:
        """prev_ids [..., B] -> e [..., B, r]."""
        return jnp.take(self.w1[...], prev_ids, axis=0)

    def logit_bias(self, prev_ids: jax.Array, dtype) -> jax.Array:
        """prev_ids [...] -> the logit bias W1[prev] @ W2 [..., V_draft] in fp32, both factors in `dtype` (the
        drafter's compute dtype, as the training loss's chunks take them). The fused loss applies W2 per
        vocabulary chunk instead (no full [rows, V] array); this is the reference and the inference path."""
        return jnp.dot(self.prev_embeddings(prev_ids).astype(dtype), self.w2[...].astype(dtype),
                       preferred_element_type=jnp.float32)

    def greedy_chain(self, base_logits: jax.Array, first_prev: jax.Array, dtype) -> jax.Array:
        """DSpark's drafting (vLLM's DSpark speculator, greedy): base_logits [b, D, V] of one block's slots,
        first_prev [b] the bonus token -> drafts [b, D], left to right: draft_k = argmax(base_logits[:, k] +
        bias(prev_k)) with prev_0 = the bonus and prev_k = draft_{k-1}. Ties go to the lowest id."""
        def step(prev, logits):
            token = jnp.argmax(logits + self.logit_bias(prev, dtype), axis=-1).astype(jnp.int32)
            return token, token

        _, drafts = jax.lax.scan(step, first_prev.astype(jnp.int32), jnp.moveaxis(base_logits, 1, 0))
        return jnp.moveaxis(drafts, 0, 1)


class ConfidenceHead(nnx.Module):
    """Linear [H + r] -> 1 with bias on [h ; e]."""

    def __init__(self, hidden_size: int, rank: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        fan_in = hidden_size + rank
        self.kernel = param(_linear_default_uniform(rngs.params(), (fan_in, 1), fan_in, param_dtype),
                            ("confidence_in", None))
        self.bias = param(_linear_default_uniform(rngs.params(), (1,), fan_in, param_dtype), (None,))

    def __call__(self, hidden: jax.Array, prev_embeddings: jax.Array) -> jax.Array:
        """hidden [..., H], e [..., r] -> confidence logits [...]."""
        features = jnp.concatenate([hidden, prev_embeddings.astype(hidden.dtype)], axis=-1)
        kernel = self.kernel[...].astype(features.dtype)
        return (jnp.dot(features, kernel) + self.bias[...].astype(features.dtype))[..., 0]
