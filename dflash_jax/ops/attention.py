"""Causal self-attention within segments (the targets' attention), with grouped-query heads.

Packed rows hold several documents; a token attends to earlier tokens of its own segment only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a fully masked row gives a uniform (not NaN) softmax; no real row is fully masked


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """softmax(q·kᵀ·scale + mask)·v with GQA: query head h uses kv head h // (Hq / Hkv).

    q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; visible: [B, Tq, Tk] bool. Scores and softmax in fp32.
    """
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    q = q.reshape(batch, q_len, kv_heads, group, head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return out.reshape(batch, q_len, q_heads, head_dim)


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T, T] bool: key j visible from query i iff j <= i and both lie in the same segment."""
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_segment


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float) -> jax.Array:
    """Causal, segment-restricted attention. q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; segment_ids: [B, T]."""
    return grouped_attention(q, k, v, causal_segment_mask(segment_ids), scale)
