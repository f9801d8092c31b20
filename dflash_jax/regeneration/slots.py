"""Cache surgery for continuous batching (design §14): a row of a decode cache is refilled with a new prompt's
prefill, and the cache's columns are shifted left when the room past its current column runs out.

Every row of a decode cache sits at the same column (the cache's one `length`), so a prompt prefilled into a
row is written right-aligned to end just before that column, as if it had been left-padded into the batch's
first prefill; the row's earlier columns get NO_SEGMENT, so no later token sees the record that row held
before. Both target families keep two kinds of arrays per layer: attention keys/values indexed by column
([layers, b, capacity, ...]) and, for Gated DeltaNet, per-row states with no column axis (conv window and
recurrent state, [layers, b, ...]); the segment ids are [b, capacity].
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dflash_jax.models.qwen3 import KVCache
from dflash_jax.models.qwen3_5 import HybridCache
from dflash_jax.models.qwen3_5_config import LINEAR_ATTENTION
from dflash_jax.models.target import NO_SEGMENT

Cache = KVCache | HybridCache
ArrayFn = Callable[[jax.Array, jax.Array], jax.Array]  # (the cache's array, the prefill's array) -> new array


def _map_layers(target, cache: Cache, prefill: Cache, columns: ArrayFn, rows: ArrayFn) -> Cache:
    """The cache with `columns` applied to every column-indexed array and `rows` to every per-row state."""
    if isinstance(cache, KVCache):
        return cache._replace(keys=columns(cache.keys, prefill.keys), values=columns(cache.values, prefill.values))
    layers = tuple(tuple((rows if layer_type == LINEAR_ATTENTION else columns)(array, new)
                         for array, new in zip(arrays, new_arrays))
                   for layer_type, arrays, new_arrays in zip(target.config.layer_period(), cache.layers,
                                                             prefill.layers))
    return cache._replace(layers=layers)


def place_rows(target, cache: Cache, prefill: Cache, rows: jax.Array) -> Cache:
    """`cache` with its rows `rows` [k] replaced by the k rows of `prefill` (a cache of W columns, all of them
    fed), their columns landing at cache.length - W .. cache.length - 1. A row index out of range (e.g. the
    batch size) is a padding row of the prefill and is dropped."""
    width = prefill.segment_ids.shape[1]
    first = cache.length - width
    columns = first + jnp.arange(width)

    def place_columns(array, new):  # [L, b, C, ...] <- [L, k, W, ...] at (rows, columns)
        return array.at[:, rows[:, None], columns[None, :]].set(new.astype(array.dtype), mode="drop")

    def place_states(array, new):  # [L, b, ...] <- [L, k, ...]
        return array.at[:, rows].set(new.astype(array.dtype), mode="drop")

    cache = _map_layers(target, cache, prefill, place_columns, place_states)
    capacity = cache.segment_ids.shape[1]
    segments = jnp.full((rows.shape[0], capacity), NO_SEGMENT, jnp.int32)
    segments = jax.lax.dynamic_update_slice_in_dim(segments, prefill.segment_ids, first, axis=1)
    return cache._replace(segment_ids=cache.segment_ids.at[rows].set(segments, mode="drop"))


def map_rows(target, cache: Cache, fn: Callable[[jax.Array], jax.Array]) -> Cache:
    """The cache with `fn` applied to every per-layer array (each has the rows on axis 1)."""
    return _map_layers(target, cache, cache, lambda array, _: fn(array), lambda array, _: fn(array))


def shift_left(target, cache: Cache, shift: jax.Array) -> Cache:
    """The cache with every column moved `shift` columns left (the first `shift` dropped) and its length
    reduced by as much; the columns freed at the end hold NO_SEGMENT, so they are never seen."""
    def roll(array, _):
        return jnp.roll(array, -shift, axis=2)

    cache = _map_layers(target, cache, cache, roll, lambda array, _: array)
    capacity = cache.segment_ids.shape[1]
    segments = jnp.roll(cache.segment_ids, -shift, axis=1)
    segments = jnp.where(jnp.arange(capacity)[None] < capacity - shift, segments, NO_SEGMENT)
    return cache._replace(segment_ids=segments, length=cache.length - shift)
