"""Causal self-attention within segments (the targets' attention), with grouped-query heads.

Packed rows hold several documents; a token attends to earlier tokens of its own segment only.
`causal_attention` is the targets' full-sequence XLA path: it walks query chunks, each over the keys up to its
own end, so the [T, T] scores of a whole row never exist (at T = 4096 and 32 heads they would be 2 GiB of
fp32 per row and layer). Rows of more than CHUNKS_IN_FLIGHT chunks walk them in a loop instead, one chunk's key
tile at a time, flash-attention style, so that their memory stays linear in T. `grouped_attention` under an
explicit mask is the dense form, used by the KV-cached decoding paths and as the tests' oracle;
`head_major_attention` is the same on operands already laid out head-major, which the chunked paths (here and
ops/dflash_attention.py) prepare once per call.
`causal_attention_fused` is the GPU path: the same attention through `jax.nn.dot_product_attention` on cuDNN.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from dflash_jax.ops.backends import compile_device, compile_platform
from dflash_jax.planning.chips import chip_of_kind

log = logging.getLogger(__name__)

MASKED_SCORE = -1e30  # finite, so a fully masked row gives a uniform (not NaN) softmax; no real row is fully masked
# Queries per chunk of `causal_attention`: a chunk's scores are at most [B, Hq, chunk, T] fp32 (the last
# chunk's), an eighth of the whole row's at T = 4096 for 512. By the platform compiled for: on CPU 256 was the
# fastest of 64-2048 at T = 2048 and 4096 (bench/bench_target_attention_chunks.py, bench/RESULTS.md; 21% less
# time than 512 at T = 2048, and less memory); elsewhere the XLA path is the fallback of the cuDNN and splash
# kernels and keeps 512 until measured there (bench/gpu.sh runs the same sweep).
QUERY_CHUNK = 512
QUERY_CHUNK_BY_PLATFORM = {"cpu": 256}
# Up to this many query chunks are independent slices of the row (the scheduler runs them side by side: a row's
# scores then add up to T x T / 2, 10 GiB of temporaries for a tiny hybrid target at T = 32K); a longer row
# walks its chunks in a loop, scoring one [chunk, chunk] key tile at a time. Rows of up to 4K tokens on CPU (8K
# elsewhere) keep the unrolled chunks.
CHUNKS_IN_FLIGHT = 16


def default_query_chunk() -> int:
    return QUERY_CHUNK_BY_PLATFORM.get(compile_platform(), QUERY_CHUNK)


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
                     query_chunk: int | None = None) -> jax.Array:
    """Causal, segment-restricted attention. q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; segment_ids: [B, T].

    Queries start..stop-1 can only see keys 0..stop-1, so each chunk scores against that prefix alone: static
    slices, about half the dense form's work. q, k and v are put head-major once ([B, Hkv, T, group, D] and
    [B, Hkv, T, D]), so no chunk copies its slice of the keys into the layout its matmuls need. The chunks are
    independent, so how many of them are in flight at once is the XLA scheduler's choice (XLA:CPU runs them
    side by side: see bench/RESULTS.md). No jax.checkpoint: the targets' forward is never differentiated.
    query_chunk: queries per chunk (default: `default_query_chunk()`, by platform).
    """
    batch, length, q_heads, head_dim = q.shape
    if query_chunk is None:
        query_chunk = default_query_chunk()
    # A row of at most two chunks is split in halves all the same: the first half's queries skip the second
    # half's keys, 3/4 of the dense form's work (at T = 384 the attention takes a quarter less time on CPU).
    query_chunk = min(query_chunk, -(-length // 2))
    q, k, v = to_head_major(q, k.shape[2]), k.swapaxes(1, 2), v.swapaxes(1, 2)
    if length > CHUNKS_IN_FLIGHT * query_chunk:
        out = tiled_causal_attention(q, k, v, segment_ids, segment_ids, scale, query_chunk)
        return out.swapaxes(1, 2).reshape(batch, length, q_heads, head_dim)
    outputs = []
    for start in range(0, length, query_chunk):
        stop = min(start + query_chunk, length)
        visible = causal_segment_mask(segment_ids[:, start:stop], segment_ids[:, :stop], start)
        outputs.append(head_major_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], visible, scale))
    return jnp.concatenate(outputs, axis=2).swapaxes(1, 2).reshape(batch, length, q_heads, head_dim)


def tiled_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, query_segments: jax.Array,
                           key_segments: jax.Array, scale: float, chunk: int, first_query=0) -> jax.Array:
    """`causal_attention` on head-major operands (q [B, Hkv, Tq, group, D] at row positions first_query.., k, v
    [B, Hkv, Tk, D] at 0..Tk-1; segments [B, Tq] and [B, Tk]) as loops: each query chunk takes in the key tiles up
    to its own end one at a time with the online softmax of flash attention (Dao et al. 2022: a running maximum
    m, exponential sum l and weighted values acc per query row). Only one [chunk, chunk] tile's scores exist at a
    time. Queries and keys are padded to whole chunks; a padded key lies after every real query, so causality
    hides it. The last tile holds each query's own key, so a row whose earlier tiles were fully masked has those
    tiles' weights rescaled to zero by then. first_query may be traced (a shard's offset in its row, design §19):
    the tiles a chunk takes in are then counted at run time."""
    length = q.shape[2]
    padded = -(-length // chunk) * chunk
    key_tiles = -(-k.shape[2] // chunk)
    q = jnp.pad(q, [(0, 0), (0, 0), (0, padded - length), (0, 0), (0, 0)])
    k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, key_tiles * chunk - x.shape[2]), (0, 0)]) for x in (k, v))
    query_segments = jnp.pad(query_segments, [(0, 0), (0, padded - length)])
    key_segments = jnp.pad(key_segments, [(0, 0), (0, key_tiles * chunk - key_segments.shape[1])])

    def query_chunk(index):
        start = index * chunk
        q_chunk = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=2)
        q_segments = jax.lax.dynamic_slice_in_dim(query_segments, start, chunk, axis=1)

        def key_tile(tile, carry):
            m, l, acc = carry
            k_tile, v_tile = (jax.lax.dynamic_slice_in_dim(x, tile * chunk, chunk, axis=2) for x in (k, v))
            k_segments = jax.lax.dynamic_slice_in_dim(key_segments, tile * chunk, chunk, axis=1)
            visible = causal_segment_mask(q_segments, k_segments, first_query + start - tile * chunk)
            scores = jnp.einsum("bhqgd,bhkd->bhqgk", q_chunk, k_tile, preferred_element_type=jnp.float32) * scale
            scores = jnp.where(visible[:, None, :, None, :], scores, MASKED_SCORE)
            m_new = jnp.maximum(m, scores.max(axis=-1))
            probs = jnp.exp(scores - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            acc = acc * rescale[..., None] + jnp.einsum("bhqgk,bhkd->bhqgd", probs, v_tile.astype(jnp.float32))
            return m_new, l * rescale + probs.sum(axis=-1), acc

        row = q_chunk[..., 0]  # (`_like`: inside shard_map the carry then varies over the mesh as q does)
        init = (jnp.full_like(row, MASKED_SCORE, jnp.float32), jnp.zeros_like(row, jnp.float32),
                jnp.zeros_like(q_chunk, jnp.float32))
        last_key = first_query + start + chunk - 1  # the chunk's last query sees keys up to its own position
        tiles = jnp.minimum(last_key // chunk + 1, key_tiles)
        _, l, acc = jax.lax.fori_loop(0, tiles, key_tile, init)
        return (acc / l[..., None]).astype(v.dtype)

    chunks = jax.lax.map(query_chunk, jnp.arange(padded // chunk))  # [chunks, B, Hkv, chunk, group, D]
    out = jnp.moveaxis(chunks, 0, 2)
    return out.reshape(*out.shape[:2], padded, *out.shape[4:])[:, :, :length]


def cudnn_unsupported(q: jax.Array, k: jax.Array) -> str | None:
    """Why cuDNN's flash attention cannot take these operands ([B, T, H, D]), or None: it needs a GPU, bf16/fp16,
    a head dim that is a multiple of 8 and at most 256 from Hopper on (128 before), and an even length when a
    mask rides along (jax/_src/cudnn/fused_attention_stablehlo.py `check_is_flash_attention`)."""
    device = compile_device()
    if device.platform != "gpu":
        return f"no GPU ({device.platform})"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (cuDNN takes bfloat16 or float16)"
    capability = float(getattr(device, "compute_capability", None) or _planned_capability(device.device_kind))
    head_limit = 256 if capability >= 9.0 else 128
    if q.shape[-1] % 8 or q.shape[-1] > head_limit:
        return f"head dim {q.shape[-1]} (a multiple of 8, at most {head_limit} on compute capability {capability})"
    if q.shape[1] % 2:
        return f"odd length {q.shape[1]}"
    return None


def _planned_capability(device_kind: str) -> str:
    """The compute capability of a GPU planned for without one (its abstract device carries only its kind)."""
    chip = chip_of_kind(device_kind)
    return "0" if chip is None or chip.gpu is None else "%d.%d" % chip.gpu.compute_capability


def causal_attention_fused(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float,
                           implementation: str = "cudnn") -> jax.Array:
    """`causal_attention` through `jax.nn.dot_product_attention` (layouts [B, T, H, D], grouped heads as they
    are): is_causal lets cuDNN's flash kernel skip the tiles above the diagonal, and the documents of a packed
    row are a boolean [B, 1, T, T] same-segment mask, which cuDNN adds as a bias. implementation="xla" is the
    same call on JAX's reference path (how the tests check the wiring on CPU). When cuDNN cannot take the
    operands (`cudnn_unsupported`, or the call itself refuses) it falls back to the XLA query chunks with
    one log line."""
    reason = cudnn_unsupported(q, k) if implementation == "cudnn" else None
    if reason is None:
        same_segment = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        try:
            return jax.nn.dot_product_attention(q, k, v, mask=same_segment, scale=scale, is_causal=True,
                                                implementation=implementation)
        except (NotImplementedError, RuntimeError, ValueError) as error:  # cuDNN missing, too old, or refusing
            reason = str(error).splitlines()[0]
    log.warning("cuDNN attention cannot run here (%s); the target's attention runs in XLA query chunks", reason)
    return causal_attention(q, k, v, segment_ids, scale)
