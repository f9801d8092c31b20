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

    def bias(self, prev_embeddings: jax.Array) -> jax.Array:
        """e [..., r] -> the logit bias [..., V_draft]. The fused loss applies W2 per vocabulary chunk instead of
        calling this (no full [rows, V] array); this is the reference and the inference path."""
        return jnp.dot(prev_embeddings, self.w2[...].astype(prev_embeddings.dtype))


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
