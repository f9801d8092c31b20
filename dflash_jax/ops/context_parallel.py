"""A long row split over a mesh axis (design §19): the pieces of the targets' forward that cross shard boundaries,
and the halo (`previous_tail`, `with_halo`) the drafter's attention reads too (ops/dflash_attention.py).

Each function runs inside `jax.shard_map` over the row's axis (`axis`, e.g. "context"): every device holds one
contiguous shard of T/N tokens of the same rows, shard i holding positions [i·T/N, (i+1)·T/N). What crosses a
boundary:

- the short causal convolution of a Gated DeltaNet layer reads the K−1 inputs before a shard's first token:
  `previous_tail`, a halo from the shard before (one collective permute of K−1 positions, not a gather of the
  row);
- the gated delta rule's state: a shard cannot start before it knows the state at its first token.
  `gated_delta_rule_over_context` computes each shard's state map S_out = M·S_in + B (M is [dk, dk] per
  head) and its outputs' dependence on S_in in one local run, gathers the N small maps, and folds those of the
  shards before it: no chain of N sequential hand-offs (LASP-2, Sun et al. 2025, combines per-shard states
  the same way);
- full attention: each shard's queries against the keys of every earlier shard (`causal_attention_over_context`,
  K, V and segment ids all-gathered once a layer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dflash_jax.ops.attention import default_query_chunk, tiled_causal_attention, to_head_major
from dflash_jax.ops.gated_delta import chunked_gated_delta_rule
from dflash_jax.sharding import CONTEXT_AXIS, row_split_axes


def on_row_shards(function, *arrays: jax.Array) -> jax.Array:
    """function(*shards) run on each device's shard of `arrays` (rows [B, T, ...], their tokens split over the
    current mesh's context axis and, where they divide, the rows over the batch axes), its result
    [B/(data·fsdp), T/N, ...] joined back into rows. The batch axes are manual too: left to the partitioner, it
    gathered every row onto each device of a data group before the shard_map (the whole batch's attention on
    every device). The heads' split over tensor stays the partitioner's."""
    batch = row_split_axes(jax.sharding.get_abstract_mesh(), arrays[0].shape[0])
    row = PartitionSpec(batch or None, CONTEXT_AXIS)
    return jax.shard_map(function, in_specs=(row,) * len(arrays), out_specs=row,
                         axis_names={CONTEXT_AXIS, *batch})(*arrays)


def previous_tail(x: jax.Array, width: int, axis: str, fill) -> jax.Array:
    """[b, width, ...]: the `width` positions (axis 1) before this shard's first, from the shards before it
    (`fill` before the row's start). One collective permute per shard it reaches into, each sending only the
    positions needed; one all-gather where it is the whole prefix."""
    shards, index, length = jax.lax.axis_size(axis), jax.lax.axis_index(axis), x.shape[1]
    if width >= (shards - 1) * length:
        whole = _gather_rows(x, axis)
        padded = jnp.concatenate([jnp.full((x.shape[0], width, *x.shape[2:]), fill, x.dtype), whole], axis=1)
        return jax.lax.dynamic_slice_in_dim(padded, index * length, width, axis=1)
    pieces = []
    for back in range(math.ceil(width / length), 0, -1):  # from the farthest shard to the one just before
        take = min(length, width - (back - 1) * length)
        piece = jax.lax.ppermute(x[:, length - take:], axis, [(i, i + back) for i in range(shards - back)])
        pieces.append(jnp.where(index >= back, piece, jnp.full_like(piece, fill)))
    return jnp.concatenate(pieces, axis=1)


def _gather_rows(x: jax.Array, axis: str) -> jax.Array:
    """x's shards joined along axis 1. Its gradient is a reduce-scatter, which XLA:CPU promotes from bf16 to f32
    and, inside a shard_map beside other mesh axes, aborts on (its reducer carries a sharding annotation): on CPU
    the gather runs in f32, on every other platform in x's own dtype."""
    gather = lambda value: jax.lax.all_gather(value, axis, axis=1, tiled=True)
    return jax.lax.platform_dependent(x, cpu=lambda value: gather(value.astype(jnp.float32)).astype(value.dtype),
                                      default=gather)


def with_halo(x: jax.Array, width: int, axis: str, fill) -> jax.Array:
    """[b, width + L, ...]: this shard's x after the `width` positions before it (`previous_tail`)."""
    return jnp.concatenate([previous_tail(x, width, axis, fill), x], axis=1) if width else x


def gated_delta_rule_over_context(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                                  resets: jax.Array, axis: str, *, matmul_dtype: str = "float32") -> jax.Array:
    """`chunked_gated_delta_rule` of a whole row (starting from state 0) from its shards over `axis`; returns
    this shard's outputs [B, T/N, H, dv] (fp32). resets: [B, T/N], this shard's part of the row's resets (a
    shard whose first token starts a document has a reset there).

    The rule is linear in the state it starts from, column by column of S (a value channel's column evolves on
    its own), so one run with values [v | 0] from the state [0 | I] gives both what the shard does from 0 (its
    outputs O⁰ and final state B) and how it carries a start state S: the identity's columns end as M, and
    the outputs read qₜᵀ·(S's image at t), P. So with S the true start state: outputs O⁰ + P·S, final state
    M·S + B. The maps compose associatively; each shard folds the gathered maps of the shards before it.
    """
    batch, length, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    values = jnp.concatenate([v.astype(jnp.float32), jnp.zeros((batch, length, heads, key_dim), jnp.float32)], -1)
    identity = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (batch, heads, key_dim, key_dim))
    start = jnp.concatenate([jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32), identity], -1)
    start = _varying(start)  # the same on every shard, carried beside varying values
    out, final = chunked_gated_delta_rule(q, k, values, g, beta, resets, start, matmul_dtype=matmul_dtype)
    from_zero, carried = out[..., :value_dim], out[..., value_dim:]  # O⁰ [B, T, H, dv], P [B, T, H, dk]
    maps = jax.lax.all_gather((final[..., value_dim:], final[..., :value_dim]), axis)  # (M, B), each [N, ...]
    index = jax.lax.axis_index(axis)

    def fold(shard, state):  # the state after shard `shard`, for the shards before this one
        transition, offset = maps[0][shard], maps[1][shard]
        after = jnp.einsum("bhkj,bhjv->bhkv", transition, state, precision=jax.lax.Precision.HIGHEST) + offset
        return jnp.where(shard < index, after, state)

    state = _varying(jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32))
    state = jax.lax.fori_loop(0, jax.lax.axis_size(axis), fold, state)
    return from_zero + jnp.einsum("bthk,bhkv->bthv", carried, state, precision=jax.lax.Precision.HIGHEST)


def _varying(x: jax.Array) -> jax.Array:
    """x, the same on every shard, typed as varying over the shard_map's manual axes (the context axis and, where
    the rows split over them, the batch axes: on_row_shards), as a loop's carry beside varying values must be."""
    return jax.lax.pcast(x, jax.sharding.get_abstract_mesh().manual_axes, to="varying")


def causal_attention_over_context(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float,
                                  axis: str, query_chunk: int | None = None) -> jax.Array:
    """`causal_attention` of a whole row from its shards over `axis`: this shard's queries q [B, T/N, Hq, D]
    against the keys of the whole row up to each query (k, v [B, T/N, Hkv, D] and segment_ids [B, T/N] are this
    shard's; they are all-gathered once). Returns [B, T/N, Hq, D].

    The queries walk their chunks one after another, each taking in the key tiles up to its own end with
    flash attention's online softmax (`tiled_causal_attention`): one [chunk, chunk] tile's scores exist at a
    time, and a shard scores no key of a later shard."""
    batch, length, q_heads, head_dim = q.shape
    gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
    k, v, key_segments = gather(k), gather(v), gather(segment_ids)
    chunk = min(query_chunk or default_query_chunk(), length)
    out = tiled_causal_attention(to_head_major(q, k.shape[2]), k.swapaxes(1, 2), v.swapaxes(1, 2), segment_ids,
                                 key_segments, scale, chunk, first_query=jax.lax.axis_index(axis) * length)
    return out.swapaxes(1, 2).reshape(batch, length, q_heads, head_dim)
