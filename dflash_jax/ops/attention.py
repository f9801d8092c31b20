"""Causal self-attention within segments (the targets' attention), with grouped-query heads.

Packed rows hold several documents; a token attends to earlier tokens of its own segment only.
`causal_attention` is the targets' full-sequence XLA path: it walks query chunks, each over the keys up to its
own end, so the [T, T] scores of a whole row never exist (at T = 4096 and 32 heads they would be 2 GiB of
fp32 per row and layer). `grouped_attention` under an explicit mask is the dense form, used by the KV-cached
decoding paths and as the tests' oracle; `head_major_attention` is the same on operands already laid out
head-major, which the chunked paths (here and ops/dflash_attention.py) prepare once per call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED_SCORE = -1e30  # finite, so a fully masked row gives a uniform (not NaN) softmax; no real row is fully masked
# Queries per chunk of `causal_attention`: a chunk's scores are at most [B, Hq, QUERY_CHUNK, T] fp32 (the last
# chunk's), an eighth of the whole row's at T = 4096.
QUERY_CHUNK = 512


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """softmax(q·kᵀ·scale + mask)·v with GQA: query head h uses kv head h // (Hq / Hkv).

    q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; visible: [B, Tq, Tk] bool. Scores and softmax in fp32.
    """
    batch, q_len, q_heads, head_dim = q.shape
    out = head_major_attention(to_head_major(q, k.shape[2]), k.swapaxes(1, 2), v.swapaxes(1, 2), visible, scale)
    return out.swapaxes(1, 2).reshape(batch, q_len, q_heads, head_dim)


def to_head_major(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, T, Hq, D] -> [B, Hkv, T, group, D]: the query heads sharing a kv head sit next to their rows, so a
    matmul against that head's keys has (B, Hkv) as leading batch axes and (T, group) as its rows."""
    batch, length, q_heads, head_dim = q.shape
    return q.reshape(batch, length, kv_heads, q_heads // kv_heads, head_dim).swapaxes(1, 2)


def head_major_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """`grouped_attention` on head-major operands: q [B, Hkv, Tq, group, D]; k, v [B, Hkv, Tk, D]; visible
    [B, Tq, Tk]. Returns [B, Hkv, Tq, group, D] in v's dtype."""
    scores = jnp.einsum("bhqgd,bhkd->bhqgk", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, :, None, :], scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqgk,bhkd->bhqgd", probs, v)


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
    slices, about half the dense form's work. q, k and v are put head-major once ([B, Hkv, T, group, D] and
    [B, Hkv, T, D]), so no chunk copies its slice of the keys into the layout its matmuls need. The chunks are
    independent, so how many of them are in flight at once is the XLA scheduler's choice (XLA:CPU runs them
    side by side: see bench/RESULTS.md). No jax.checkpoint: the targets' forward is never differentiated.
    """
    batch, length, q_heads, head_dim = q.shape
    q, k, v = to_head_major(q, k.shape[2]), k.swapaxes(1, 2), v.swapaxes(1, 2)
    outputs = []
    for start in range(0, length, query_chunk):
        stop = min(start + query_chunk, length)
        visible = causal_segment_mask(segment_ids[:, start:stop], segment_ids[:, :stop], start)
        outputs.append(head_major_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], visible, scale))
    return jnp.concatenate(outputs, axis=2).swapaxes(1, 2).reshape(batch, length, q_heads, head_dim)
