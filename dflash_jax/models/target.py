"""What every frozen target model shares: its output type, feature capture, attention backends, and the
embedding and LM head the drafter borrows. Loading a target by its `model_type`: weights/targets.py."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dflash_jax.ops.attention import (causal_attention, causal_attention_fused, causal_segment_mask,
                                     default_query_chunk, grouped_attention)
from dflash_jax.ops.context_parallel import causal_attention_over_context, on_row_shards
from dflash_jax.ops.splash_attention import causal_attention_splash
from dflash_jax.sharding import CONTEXT_AXIS, context_shards

# The full-sequence attention of the targets by resolved `attention_impl` (ops/backends.py): query chunks in
# XLA, the splash kernel, or cuDNN through jax.nn.dot_product_attention. The KV-cached decoding path always
# uses the dense `grouped_attention`.
CAUSAL_ATTENTION_IMPLS = {"xla": causal_attention, "splash": causal_attention_splash, "cudnn": causal_attention_fused}

NO_SEGMENT = -1  # the segment id of decode-cache columns nothing was written to: it matches no token


class TargetOutput(NamedTuple):
    hidden: jax.Array  # [B, T, H] last decoder layer output after the final norm (input of lm_head)
    features: jax.Array  # [B, T, n, H] residual stream after each requested decoder layer, in request order
    cache: Any = None  # called with a decode cache: that cache grown by this call's tokens


class AttentionCache(NamedTuple):
    """One attention layer's part of a decode cache during a call (the targets' `init_cache`).

    Column c holds the key/value of the c-th token the cache was fed. Per row, the tokens of one call sit at
    columns start..start+t-1; segment ids tell the documents apart, so a row may begin with left padding in
    a segment of its own (batched prompts of different lengths) or hold several documents.
    """

    keys: jax.Array  # [b, capacity, kv_heads, head_dim]
    values: jax.Array  # [b, capacity, kv_heads, head_dim]
    segment_ids: jax.Array  # [b, capacity]: every column's segment, this call's tokens included
    start: jax.Array  # int32 scalar: the column of this call's first token
    # [b, t, t] bool or None: the call's tokens are a draft tree (design §9.4); token i sees this call's
    # token j iff tree[:, i, j] (j is i or one of its ancestors) instead of iff j <= i.
    tree: jax.Array | None = None


def write_columns(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buffer [b, capacity, ...] with new [b, t, ...] written at columns start..start+t-1."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, new.astype(buffer.dtype), start, axis=1)


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float,
                          attention_impl: str, mesh: Mesh | None, cache: AttentionCache | None = None
                          ) -> tuple[jax.Array, AttentionCache | None]:
    """The targets' causal attention within segments; q: [b, t, Hq, D], k, v: [b, t, Hkv, D].

    Without a cache: over the call's own tokens on the `attention_impl` backend (splash runs per shard of
    `mesh`, the device mesh the activations are sharded on; None: one device). With one: the new keys and
    values are written at columns start.. first, then every new token attends (XLA, over all columns) to the
    columns at or before its own that hold its segment, so stale columns past it (a cropped verification
    block) are never visible; with `cache.tree`, the call's own columns are seen through the tree instead.
    Returns (output, the cache holding the new columns or None). Rows split over the mesh's context axis
    (design §19) attend shard by shard to the all-gathered keys, in XLA whatever `attention_impl`.
    """
    if cache is None and context_shards() > 1:
        attention = functools.partial(causal_attention_over_context, scale=scale, axis=CONTEXT_AXIS)
        return on_row_shards(attention, q, k, v, segment_ids), None
    if cache is None:
        attention = CAUSAL_ATTENTION_IMPLS[attention_impl]
        if attention_impl == "splash":
            attention = functools.partial(attention, mesh=mesh)
        return attention(q, k, v, segment_ids, scale), None
    keys, values = write_columns(cache.keys, k, cache.start), write_columns(cache.values, v, cache.start)
    outputs = []  # a long prefill attends in query chunks, as `causal_attention`: [b, H, chunk, capacity]
    query_chunk = default_query_chunk()
    for first in range(0, q.shape[1], query_chunk):
        chunk = slice(first, first + query_chunk)
        visible = causal_segment_mask(segment_ids[:, chunk], cache.segment_ids, cache.start + first)
        if cache.tree is not None:
            visible = _through_tree(visible, cache.tree[:, chunk], cache.start)
        outputs.append(grouped_attention(q[:, chunk], keys, values, visible, scale))
    return jnp.concatenate(outputs, axis=1), cache._replace(keys=keys, values=values)


def move_columns(buffer: jax.Array, start: jax.Array, order: jax.Array, axis: int) -> jax.Array:
    """buffer with its columns start+order[0], start+order[1], ... (along `axis`) moved to start, start+1, ...:
    a verified tree's accepted path made contiguous (design §9.4)."""
    block = jax.lax.dynamic_slice_in_dim(buffer, start, order.shape[0], axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(buffer, jnp.take(block, order, axis=axis), start, axis=axis)


def _through_tree(visible: jax.Array, tree: jax.Array, start: jax.Array) -> jax.Array:
    """visible [b, q, capacity] with columns start..start+t-1 (the call's t tokens) replaced by tree [b, q, t]."""
    own = jnp.zeros(visible.shape, bool)
    own = jax.lax.dynamic_update_slice_in_dim(own, jnp.ones(tree.shape, bool), start, axis=2)
    placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(visible.shape, bool), tree, start, axis=2)
    return jnp.where(own, placed, visible)


def feature_slots(feature_layer_ids: tuple[int, ...], num_layers: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Validate feature ids; return (sorted distinct ids, the buffer slot each layer writes, request order).

    Targets capture features inside their layer scan: layer l writes its output into slot[l] of a small
    [n+1, B, T, H] buffer, and layers nobody asked for write to the spare last slot, so each layer costs one
    in-place dynamic update rather than a select over the whole buffer; buffer[order] is the request order.
    """
    for layer_id in feature_layer_ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, (int, np.integer)) \
                or not 0 <= layer_id < num_layers:
            raise ValueError(f"feature_layer_ids {tuple(feature_layer_ids)!r}: every id must be an integer "
                             f"in [0, {num_layers - 1}] for this {num_layers}-layer target")
    wanted = sorted(set(int(i) for i in feature_layer_ids))
    slot = np.full((num_layers,), len(wanted), np.int32)
    slot[wanted] = np.arange(len(wanted), dtype=np.int32)
    order = np.asarray([wanted.index(int(i)) for i in feature_layer_ids], np.int32)
    return wanted, slot, order


class EmbeddingAndHead:
    """The borrowed pieces every target exposes: `embed`, `logits` and the LM head as an [H, V] matrix.

    Mixed into target modules that own `embed_tokens` (an `Embed`), `config.tie_word_embeddings`, and an
    `lm_head` (a `Linear`) when untied.
    """

    def embed(self, ids: jax.Array) -> jax.Array:
        return self.embed_tokens(ids)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head on final-normed hidden states ([..., H] -> [..., V])."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden)

    def lm_head_kernel(self) -> jax.Array:
        """The LM head as an [H, V] matrix (the transposed embedding table when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]
