"""Qwen3.5/3.6 hybrid target (transformers models/qwen3_5/modeling_qwen3_5.py, text model) in Flax NNX.

Layers follow `layer_types`: Gated DeltaNet (`gated_deltanet.py`) or gated full attention, each followed by a
SwiGLU MLP (`qwen3_5_moe`: routed experts and a gated shared expert, `moe.py`, design §8.5), with zero-centred
(1+w) RMSNorms throughout (design §8.2). layer_types is a repetition of a period (27B: 16 × [GDN, GDN, GDN,
attention]); the layers at each position of the period are stacked along a leading `layers` axis and one
`nnx.scan` step runs one period, so compile time is that of one period whatever the depth. Requested feature
layers are captured inside the scan into a small [n, B, T, H] buffer. The attention layers run on the backend
chosen at construction (`attention_impl`, as in `qwen3.py`). Given a decode cache (`init_cache`: the attention
layers' keys/values, the Gated DeltaNet layers' conv inputs and recurrent states), the same layers run
incrementally. The Gated DeltaNet layers' chunk products run in the dtype chosen at construction
(`delta_rule_dtype`), the same in every forward of the model (design §8.3).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.models.gated_deltanet import GatedDeltaNet, RecurrentCache
from dflash_jax.models.layers import MLP, Embed, Linear, RMSNorm, apply_rope, rope_frequencies
from dflash_jax.models.moe import SparseMoE
from dflash_jax.models.qwen3_5_config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3_5Config
from dflash_jax.models.target import (NO_SEGMENT, AttentionCache, EmbeddingAndHead, TargetOutput,
                                      causal_self_attention, feature_slots, move_columns, write_columns)
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.ops.gated_delta import resolve_delta_rule_dtype
from dflash_jax.sharding import ROWS_EMBED, ROWS_HEADS, ROWS_KV_HEADS, constrain

__all__ = ["FULL_ATTENTION", "LINEAR_ATTENTION", "HybridCache", "Qwen3_5", "Qwen3_5Config"]


class HybridCache(NamedTuple):
    """The decode cache of `Qwen3_5.__call__`. layers[k] belongs to the k-th layer of the period, stacked over
    the period's repetitions: (keys, values) [R, b, capacity, kv_heads, head_dim] for gated attention (see
    `target.AttentionCache`), (conv_inputs [R, b, K−1, C], state [R, b, value heads, dk, dv] fp32) for Gated
    DeltaNet (`RecurrentCache`). A recurrent state cannot be cut back, so a call that may be partly rejected
    (`keep_every_state`, or a draft `tree`) returns per token its conv inputs [R, b, T, K−1, C] and state
    [R, b, T, ...] instead, and `Qwen3_5.keep_prefix` / `keep_path` pick the accepted token's (design §9.3,
    §9.4)."""

    layers: tuple[tuple[jax.Array, jax.Array], ...]
    segment_ids: jax.Array  # [b, capacity] int32, NO_SEGMENT where nothing was written
    length: jax.Array  # int32 scalar


class GatedAttention(nnx.Module):
    """`Qwen3_5Attention`: q_proj yields per head [query | gate]; (1+w) q_norm/k_norm; partial rotate-half
    RoPE; GQA with scale head_dim^-0.5; o_proj(attn · sigmoid(gate))."""

    def __init__(self, config: Qwen3_5Config, *, param_dtype, rngs: nnx.Rngs, attention_impl: str,
                 mesh: Mesh | None):
        hidden, dim = config.hidden_size, config.head_dim
        self.q_heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, dim
        self.attention_impl, self.mesh = attention_impl, mesh
        linear = lambda n_in, n_out, axes: Linear(n_in, n_out, axes=axes, rngs=rngs, param_dtype=param_dtype)
        # Output rows are [h0 query, h0 gate, h1 query, ...]: a tensor split over heads keeps pairs together.
        self.q_proj = linear(hidden, self.q_heads * dim * 2, ("embed", "q_heads"))
        self.k_proj = linear(hidden, self.kv_heads * dim, ("embed", "kv_heads"))
        self.v_proj = linear(hidden, self.kv_heads * dim, ("embed", "kv_heads"))
        self.o_proj = linear(self.q_heads * dim, hidden, ("q_heads", "embed"))
        norm = lambda: RMSNorm(dim, eps=config.rms_norm_eps, zero_centered=True, axis_name="head_dim",
                               param_dtype=param_dtype)
        self.q_norm, self.k_norm = norm(), norm()

    def __call__(self, x, positions, segment_ids, inv_freq, cache: AttentionCache | None = None):
        batch, length, _ = x.shape
        query_gate = constrain(self.q_proj(x).reshape(batch, length, self.q_heads, 2 * self.head_dim), ROWS_HEADS)
        q, gate = query_gate[..., :self.head_dim], query_gate[..., self.head_dim:]
        q = self.q_norm(q)
        k = self.k_norm(constrain(self.k_proj(x).reshape(batch, length, self.kv_heads, self.head_dim), ROWS_KV_HEADS))
        v = constrain(self.v_proj(x).reshape(batch, length, self.kv_heads, self.head_dim), ROWS_KV_HEADS)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out, cache = causal_self_attention(q, k, v, segment_ids, self.head_dim**-0.5, self.attention_impl, self.mesh,
                                           cache)
        out = constrain(out, ROWS_HEADS) * jax.nn.sigmoid(gate)
        return constrain(self.o_proj(out.reshape(batch, length, self.q_heads * self.head_dim)), ROWS_EMBED), cache


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x += mixer(norm(x)); x += mlp(norm(x)). The mixer attribute is named as in
    the checkpoint: `linear_attn` (Gated DeltaNet) or `self_attn` (gated attention)."""

    def __init__(self, config: Qwen3_5Config, layer_type: str, *, param_dtype, rngs: nnx.Rngs, attention_impl: str,
                 mesh: Mesh | None, delta_rule_dtype: str):
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(hidden, eps=eps, zero_centered=True, param_dtype=param_dtype)
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(
                hidden, num_key_heads=config.linear_num_key_heads, num_value_heads=config.linear_num_value_heads,
                key_head_dim=config.linear_key_head_dim, value_head_dim=config.linear_value_head_dim,
                conv_kernel_size=config.linear_conv_kernel_dim, rms_norm_eps=eps, rngs=rngs,
                param_dtype=param_dtype, delta_rule_dtype=delta_rule_dtype)
        else:
            self.self_attn = GatedAttention(config, param_dtype=param_dtype, rngs=rngs, attention_impl=attention_impl,
                                            mesh=mesh)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, zero_centered=True, param_dtype=param_dtype)
        moe = config.moe
        if moe is None:
            self.mlp = MLP(hidden, config.intermediate_size, rngs=rngs, param_dtype=param_dtype)
        else:  # qwen3_5_moe (design §8.5)
            self.mlp = SparseMoE(hidden, moe.expert_intermediate_size, moe.num_experts, moe.top_k,
                                 moe.normalize_top_k, shared_intermediate_size=moe.shared_expert_intermediate_size,
                                 rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x, positions, segment_ids, inv_freq, cache: AttentionCache | RecurrentCache | None = None,
                 seen: jax.Array | None = None):
        normed = self.input_layernorm(x)
        if self.layer_type == LINEAR_ATTENTION:
            mixed, cache = self.linear_attn(normed, segment_ids, cache, seen)
        else:
            mixed, cache = self.self_attn(normed, positions, segment_ids, inv_freq, cache)
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LayerPeriod(nnx.Module):
    """One period of layer_types: `layers[k]` is the k-th decoder layer of the period."""

    def __init__(self, config: Qwen3_5Config, *, param_dtype, rngs: nnx.Rngs, attention_impl: str,
                 mesh: Mesh | None, delta_rule_dtype: str):
        self.layers = nnx.List([DecoderLayer(config, layer_type, param_dtype=param_dtype, rngs=rngs,
                                             attention_impl=attention_impl, mesh=mesh,
                                             delta_rule_dtype=delta_rule_dtype)
                                for layer_type in config.layer_period()])


class Qwen3_5(EmbeddingAndHead, nnx.Module):
    """Qwen3_5ForCausalLM text model. `periods` holds the decoder layers: periods.layers[k] is stacked over
    the repetitions of the period, so HF layer i is periods.layers[i % p][i // p] (p = period length).
    attention_impl, mesh: the attention layers' backend, "xla", "splash" or "auto", and the device mesh splash
    runs per shard of (see `Qwen3`). delta_rule_dtype: the Gated DeltaNet chunk products, "float32", "bfloat16"
    or "auto" (bfloat16 unless the mesh's devices, else JAX's default backend, are CPUs;
    config.target_matmul_dtype), fixed here so that every forward of the model computes the same products."""

    def __init__(self, config: Qwen3_5Config, *, param_dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_impl: str = "xla", mesh: Mesh | None = None, delta_rule_dtype: str = "float32"):
        self.config = config
        attention_impl = resolve_attention_impl(attention_impl)
        delta_rule_dtype = resolve_delta_rule_dtype(delta_rule_dtype,
                                                    None if mesh is None else mesh.devices.flat[0].platform)
        self.delta_rule_dtype = delta_rule_dtype
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, rngs=rngs, param_dtype=param_dtype)
        repeats = config.num_hidden_layers // len(config.layer_period())

        @nnx.split_rngs(splits=repeats)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_periods(period_rngs):
            return LayerPeriod(config, param_dtype=param_dtype, rngs=period_rngs, attention_impl=attention_impl,
                               mesh=mesh, delta_rule_dtype=delta_rule_dtype)

        self.periods = make_periods(rngs)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=True,
                            param_dtype=param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, axes=("embed", "vocab"), rngs=rngs,
                                  param_dtype=param_dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 feature_layer_ids: tuple[int, ...] = (), cache: HybridCache | None = None,
                 keep_every_state: bool = False, tree: jax.Array | None = None) -> TargetOutput:
        """input_ids, positions, segment_ids: [B, T] (positions restart in each packed document; attention,
        convolution and recurrent state never cross a segment boundary).

        features[:, :, i] is the residual stream right after decoder layer feature_layer_ids[i]
        (transformers `hidden_states[id + 1]`, except that HF's last entry is already final-normed).

        With a decode cache (`init_cache`) the tokens continue what it holds, as in `Qwen3.__call__`; a
        token whose segment differs from the last cached token's starts fresh conv and recurrent state.
        keep_every_state: the returned cache may then be cut back to any prefix of these tokens with
        `keep_prefix` (and must be, before the next call), as a speculative verification needs. tree [B, T, T]
        (with a cache): the tokens are a draft tree (as `Qwen3.__call__`): attention sees the cached columns
        and a token's ancestors, each Gated DeltaNet token follows its own root path, and `keep_path` keeps one.
        """
        config = self.config
        num_layers, period = config.num_hidden_layers, len(config.layer_period())
        wanted, slot, order = feature_slots(feature_layer_ids, num_layers)

        x = constrain(self.embed(input_ids), ROWS_EMBED)
        inv_freq = rope_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling,
                                    config.max_position_embeddings)
        buffer = constrain(jnp.zeros((len(wanted) + 1, *x.shape), x.dtype), (None, *ROWS_EMBED))
        seen = None
        if cache is not None:
            start = cache.length
            # The segments of the K−1 tokens before this call (NO_SEGMENT before the first), for the convs.
            earlier = jnp.full((x.shape[0], config.linear_conv_kernel_dim - 1), NO_SEGMENT, jnp.int32)
            history_segments = jax.lax.dynamic_slice_in_dim(
                jnp.concatenate([earlier, cache.segment_ids], axis=1), start, earlier.shape[1], axis=1)
            cache = cache._replace(segment_ids=write_columns(cache.segment_ids, segment_ids, start))
            # The call's tokens each Gated DeltaNet token follows, when it keeps every state: its ancestors
            # in a tree, else its prefix.
            seen = tree
            if tree is None and keep_every_state:
                batch, length = input_ids.shape
                seen = jnp.broadcast_to(jnp.tri(length, dtype=bool), (batch, length, length))

        def layer_cache(layer, arrays):
            if arrays is None:
                return None
            if layer.layer_type == LINEAR_ATTENTION:
                return RecurrentCache(*arrays, history_segments)
            return AttentionCache(*arrays, cache.segment_ids, start, tree)

        # Tree mode, as in qwen3.py: also works when a caller's trace (jit, an accumulation scan) closes over
        # the model.
        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0), graph=False)
        def run_period(carry, layer_period, period_slots, period_arrays):
            hidden, features = carry
            new_arrays = []
            for position, layer in enumerate(layer_period.layers):
                arrays = None if period_arrays is None else period_arrays[position]
                hidden, updated = layer(hidden, positions, segment_ids, inv_freq, layer_cache(layer, arrays),
                                        seen)
                hidden = constrain(hidden, ROWS_EMBED)
                new_arrays.append(None if updated is None else tuple(updated[:2]))
                features = jax.lax.dynamic_update_index_in_dim(features, hidden, period_slots[position], axis=0)
            return (hidden, features), None if period_arrays is None else tuple(new_arrays)

        (x, buffer), layer_arrays = run_period((x, buffer), self.periods, jnp.asarray(slot.reshape(-1, period)),
                                               None if cache is None else cache.layers)
        if cache is not None:
            cache = HybridCache(layer_arrays, cache.segment_ids, start + input_ids.shape[1])
        features = jnp.moveaxis(buffer[order], 0, 2)  # [B, T, n, H], in request order
        return TargetOutput(hidden=self.norm(x), features=features, cache=cache)

    def keep_prefix(self, cache: HybridCache, length: jax.Array) -> HybridCache:
        """The cache of a `keep_every_state` call of T tokens cut back to its first `length` columns (1 to T
        of them from that call): each Gated DeltaNet layer keeps the state after the last kept token and the
        conv inputs of the K−1 tokens up to it; attention columns past `length` stay as stale entries that no
        later token sees (design §9.3)."""
        call_length = self._call_length(cache)
        return self._keep_token(cache, length - (cache.length - call_length) - 1, length)

    def keep_path(self, cache: HybridCache, start: jax.Array, path: jax.Array, length: jax.Array) -> HybridCache:
        """After a tree call at columns start.. (as `Qwen3.keep_path`): the attention K/V of path[0], path[1],
        ... moved to columns start, start+1, ..., each Gated DeltaNet layer at the state and conv window of
        the last kept node, path[length - start - 1] (design §9.4)."""
        cache = self._keep_token(cache, path[length - start - 1], length)
        layers = tuple(arrays if layer_type == LINEAR_ATTENTION else
                       tuple(move_columns(buffer, start, path, axis=2) for buffer in arrays)
                       for layer_type, arrays in zip(self.config.layer_period(), cache.layers))
        return cache._replace(layers=layers)

    def _call_length(self, cache: HybridCache) -> int:
        """T of the per-token call that made this cache (its Gated DeltaNet arrays are [R, b, T, ...])."""
        linear = self.config.layer_period().index(LINEAR_ATTENTION)
        return cache.layers[linear][1].shape[2]

    def _keep_token(self, cache: HybridCache, token: jax.Array, length: jax.Array) -> HybridCache:
        """Each Gated DeltaNet layer's conv inputs and state as after the call's token `token`; length set."""
        layers = tuple((tuple(jax.lax.dynamic_index_in_dim(a, token, axis=2, keepdims=False) for a in arrays)
                        if layer_type == LINEAR_ATTENTION else arrays)
                       for layer_type, arrays in zip(self.config.layer_period(), cache.layers))
        return HybridCache(layers, cache.segment_ids, jnp.asarray(length, jnp.int32))

    def init_cache(self, batch: int, capacity: int, dtype=None) -> HybridCache:
        """An empty decode cache of `capacity` columns per row (dtype: the weights' dtype unless given; the
        recurrent states are fp32 whatever it is, as the gated delta rule)."""
        config = self.config
        dtype = dtype or self.embed_tokens.embedding[...].dtype
        repeats = config.num_hidden_layers // len(config.layer_period())
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        layers = []
        for layer_type in config.layer_period():
            if layer_type == LINEAR_ATTENTION:
                conv = (repeats, batch, config.linear_conv_kernel_dim - 1, 2 * key_dim + value_dim)
                state = (repeats, batch, config.linear_num_value_heads, config.linear_key_head_dim,
                         config.linear_value_head_dim)
                layers.append((jnp.zeros(conv, dtype), jnp.zeros(state, jnp.float32)))
            else:
                kv = (repeats, batch, capacity, config.num_key_value_heads, config.head_dim)
                layers.append((jnp.zeros(kv, dtype), jnp.zeros(kv, dtype)))
        return HybridCache(tuple(layers), jnp.full((batch, capacity), NO_SEGMENT, jnp.int32),
                           jnp.zeros((), jnp.int32))
