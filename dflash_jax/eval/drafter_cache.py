"""The drafter at inference: its context keys/values cached, one block drafted per verification step.

Reference §8.1 (z-lab `dflash_generate`): each layer's context K/V = k_norm/RoPE(k_proj(ctx)) and
v_proj(ctx), ctx = hidden_norm(fc(features)), are computed once per committed position and kept; the
block's own K/V are used for one draft and discarded. The block at anchor `start` (the bonus token, whose
target features do not exist yet) sees context columns p < start (and p > start + k - W on sliding layers)
and its own slots, by the same mask rules as training (`ops/mask.py`, design §5). This runs the Drafter's own
submodules, so it is numerically the `Drafter.__call__` of one anchor; tests/test_generate.py checks it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.drafter import Drafter
from dflash_jax.models.layers import apply_rope, rope_inverse_frequencies
from dflash_jax.ops.attention import grouped_attention
from dflash_jax.ops.mask import block_rule, context_rule


class DrafterCache(NamedTuple):
    """Context keys (after k_norm and RoPE) and values per drafter layer; column = position."""

    keys: jax.Array  # [layers, b, capacity, kv_heads, head_dim]
    values: jax.Array  # [layers, b, capacity, kv_heads, head_dim]


def _heads(x: jax.Array, num_heads: int, head_dim: int) -> jax.Array:
    return x.reshape(*x.shape[:2], num_heads, head_dim)


def _inv_freq(drafter: Drafter) -> np.ndarray:
    config = drafter.config
    return rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)


def init_drafter_cache(drafter: Drafter, batch: int, capacity: int) -> DrafterCache:
    config = drafter.config
    shape = (config.num_hidden_layers, batch, capacity, config.num_key_value_heads, config.head_dim)
    return DrafterCache(jnp.zeros(shape, drafter.dtype), jnp.zeros(shape, drafter.dtype))


def add_context(drafter: Drafter, cache: DrafterCache, features: jax.Array, start) -> DrafterCache:
    """Write the context K/V of features [b, t, n*H] (target positions start..start+t-1) into the cache.

    Rows past the committed ones may be written too (e.g. the rejected part of a verification block): they
    sit at columns >= the next anchor, so they stay invisible until real context overwrites them.
    """
    config = drafter.config
    ctx = drafter.hidden_norm(drafter.fc(features))
    positions = jnp.broadcast_to(start + jnp.arange(features.shape[1]), features.shape[:2])
    inv_freq = _inv_freq(drafter)
    keys, values = [], []
    for index, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        k = attn.k_norm(_heads(attn.k_proj(ctx), config.num_key_value_heads, config.head_dim))
        k = apply_rope(k, positions, inv_freq)
        v = _heads(attn.v_proj(ctx), config.num_key_value_heads, config.head_dim)
        keys.append(jax.lax.dynamic_update_slice_in_dim(cache.keys[index], k.astype(cache.keys.dtype), start, 1))
        values.append(jax.lax.dynamic_update_slice_in_dim(cache.values[index], v.astype(cache.values.dtype),
                                                          start, 1))
    return DrafterCache(jnp.stack(keys), jnp.stack(values))


def draft_block(drafter: Drafter, cache: DrafterCache, block_embeds: jax.Array, start) -> jax.Array:
    """Hidden states [b, B, H] (after the drafter's final norm) of the block at anchor position `start`.

    block_embeds: [b, B, H], the target's embedding of [bonus, mask, ..., mask].
    """
    config = drafter.config
    block = block_embeds.shape[1]
    slots = np.arange(block)
    positions = jnp.broadcast_to(start + jnp.arange(block), block_embeds.shape[:2])
    columns = jnp.arange(cache.keys.shape[2])
    inv_freq = _inv_freq(drafter)
    x = block_embeds.astype(drafter.dtype)
    for index, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        window = config.window(index)
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(_heads(attn.q_proj(h), config.num_attention_heads, config.head_dim)),
                       positions, inv_freq)
        k = apply_rope(attn.k_norm(_heads(attn.k_proj(h), config.num_key_value_heads, config.head_dim)),
                       positions, inv_freq)
        v = _heads(attn.v_proj(h), config.num_key_value_heads, config.head_dim)
        context = jnp.broadcast_to(context_rule(start, slots[:, None], columns[None, :], window),
                                   (block, columns.shape[0]))
        own_block = jnp.asarray(block_rule(slots[:, None], slots[None, :], block, causal=window is not None))
        visible = jnp.concatenate([context, own_block], axis=1)
        keys = jnp.concatenate([cache.keys[index], k.astype(cache.keys.dtype)], axis=1)
        values = jnp.concatenate([cache.values[index], v.astype(cache.values.dtype)], axis=1)
        out = grouped_attention(q, keys, values, jnp.broadcast_to(visible, (x.shape[0], *visible.shape)),
                                config.head_dim**-0.5).astype(q.dtype)
        x = x + attn.o_proj(out.reshape(*out.shape[:2], config.num_attention_heads * config.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)
