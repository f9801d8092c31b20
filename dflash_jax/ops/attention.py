"""Causal self-attention within segments (the targets' attention), with grouped-query heads.

Packed rows hold several documents; a token attends to earlier tokens of its own segment only.
`causal_attention` is the targets' full-sequence XLA path: it walks query chunks, each over the keys up to its
own end, so the [T, T] scores of a whole row never exist (at T = 4096 and 32 heads they would be 2 GiB of
fp32 per row and layer). `grouped_attention` under an explicit mask is the dense form, used per chunk here, by
the KV-cached decoding path and by the drafter's XLA attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a fully masked row gives a uniform (not NaN) softmax; no real row is fully masked
# Queries per chunk of `causal_attention`: a chunk's scores are at most [B, Hq, QUERY_CHUNK, T] fp32 (the last
# chunk's), an eighth of the whole row's at T = 4096.
QUERY_CHUNK = 512


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


def causal_segment_mask(query_segments: jax.Array, key_segments: jax.Array, first_query: int = 0) -> jax.Array:
    """[B, Tq, Tk] bool for queries at row positions first_query.. and keys at 0..Tk-1: key j is visible from
    query i iff j <= first_query + i and both lie in the same segment. segments: [B, Tq] and [B, Tk]."""
    query_index = first_query + jnp.arange(query_segments.shape[1])
    causal = query_index[:, None] >= jnp.arange(key_segments.shape[1])[None, :]
    same_segment = query_segments[:, :, None] == key_segments[:, None, :]
    return causal[None] & same_segment


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float,
                     query_chunk: int = QUERY_CHUNK) -> jax.Array:
    """Causal, segment-restricted attention. q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; segment_ids: [B, T].

    Queries start..stop-1 can only see keys 0..stop-1, so each chunk scores against that prefix alone: static
    slices, about half the dense form's work. The chunks are independent, so how many of them are in flight
    at once is the XLA scheduler's choice (XLA:CPU runs them side by side: see bench/RESULTS.md). No
    jax.checkpoint: the targets' forward is never differentiated.
    """
    length = q.shape[1]
    outputs = []
    for start in range(0, length, query_chunk):
        stop = min(start + query_chunk, length)
        visible = causal_segment_mask(segment_ids[:, start:stop], segment_ids[:, :stop], start)
        outputs.append(grouped_attention(q[:, start:stop], k[:, :stop], v[:, :stop], visible, scale))
    return jnp.concatenate(outputs, axis=1)
