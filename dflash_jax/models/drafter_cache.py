"""The drafter's decoding cache (design §14.1): the context keys (after k_norm and RoPE) and values of each layer.

A full-attention layer keeps every context column (column = position, `capacity` of them). A sliding layer of
window W sees, from the block at anchor a, only positions a - W < p < a (design §5), so it keeps a ring of
R = min(W, capacity) columns: slot i holds the newest position below the anchor that is i modulo R. Every position
below the anchor was written by some step (each step writes the context from its own start on, and a step's start
is the previous anchor's position or earlier), so after a write slot i holds position (a - 1) - ((a - 1 - i) mod R),
known from the anchor alone; a slot whose position would be negative was never written and is masked. A 128K-token
prompt then holds W columns in each sliding layer instead of 128K.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DrafterCache(NamedTuple):
    keys: jax.Array  # [full-attention layers, b, capacity, kv_heads, head_dim]
    values: jax.Array
    window_keys: jax.Array  # [sliding layers, b, W, kv_heads, head_dim]
    window_values: jax.Array


def empty_cache(layer_windows: list[int | None], batch: int, capacity: int, kv_heads: int, head_dim: int,
                dtype) -> DrafterCache:
    """An empty cache for layers of these windows (None: full attention)."""
    full = sum(window is None for window in layer_windows)
    windows = {window for window in layer_windows if window is not None}
    # One window for all sliding layers (DrafterConfig.sliding_window); a cache of fewer columns holds every position.
    width = min(windows.pop(), capacity) if windows else 1
    full_shape = (full, batch, capacity, kv_heads, head_dim)
    ring_shape = (len(layer_windows) - full, batch, width, kv_heads, head_dim)
    return DrafterCache(jnp.zeros(full_shape, dtype), jnp.zeros(full_shape, dtype), jnp.zeros(ring_shape, dtype),
                        jnp.zeros(ring_shape, dtype))


def ring_positions(anchor: jax.Array, size: int) -> jax.Array:
    """[size] the position each ring slot holds once the context below `anchor` is written (negative: none)."""
    last = anchor - 1
    return last - jnp.mod(last - jnp.arange(size), size)


def write_columns(cached: jax.Array, new: jax.Array, context_start: jax.Array) -> jax.Array:
    """A full layer's [b, capacity, ...] columns with new [b, t, ...] written at context_start.."""
    return jax.lax.dynamic_update_slice_in_dim(cached, new.astype(cached.dtype), context_start, axis=1)


def write_ring(ring: jax.Array, new: jax.Array, context_start: jax.Array, anchor: jax.Array) -> jax.Array:
    """A sliding layer's ring [b, W, ...] after the new context [b, t, ...] at positions context_start.. is
    written; positions at or past the anchor (a rejected draft's, the prompt's padding) are never written, so
    they cannot take the slot of a position still in view."""
    positions = ring_positions(anchor, ring.shape[1])
    offset = positions - context_start  # where each slot's position sits among the new columns (< t: it is < anchor)
    taken = jnp.take(new, jnp.clip(offset, 0, new.shape[1] - 1), axis=1).astype(ring.dtype)
    fresh = (offset >= 0).reshape(1, -1, *(1,) * (ring.ndim - 2))
    return jnp.where(fresh, taken, ring)
