"""Qwen3 dense target (transformers `models/qwen3/modeling_qwen3.py`) in Flax NNX.

Decoder layers are stacked along a leading `layers` axis and run with `nnx.scan`, so compile time does not
grow with depth. Requested feature layers are captured inside the scan into a small [n, B, T, H] buffer.
`__call__` runs the full-sequence attention on the backend chosen at construction (`attention_impl`: query
chunks in XLA, or splash on TPU); given a decode cache (`init_cache`), the same layers run incrementally over
cached keys/values (regeneration; speculative decoding's prefill and verification, design §9), attention in XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.models.moe import SparseMoE
from dflash_jax.models.moe_config import MoeSettings
from dflash_jax.models.layers import (MLP, Embed, Linear, RMSNorm, apply_rope, decoder_layer_params,
                                      rope_frequencies)
from dflash_jax.models.target import (NO_SEGMENT, AttentionCache, EmbeddingAndHead, TargetOutput,
                                      causal_self_attention, feature_slots, move_columns, write_columns)
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.sharding import ROWS_EMBED, ROWS_HEADS, ROWS_KV_HEADS, constrain

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = dataclasses.field(default=None, hash=False)  # None = default RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    moe: MoeSettings | None = None  # qwen3_moe: routed experts (design §8.5); None = dense MLP in every layer

    def __post_init__(self):
        for name in (*_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen3 config field {name!r} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Qwen3 config field {name!r} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Qwen3 config field 'num_attention_heads' ({self.num_attention_heads}) must be a "
                             f"multiple of 'num_key_value_heads' ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3 config field 'head_dim' must be even for RoPE, got {self.head_dim}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"Qwen3 config field 'tie_word_embeddings' must be a bool, "
                             f"got {self.tie_word_embeddings!r}")
        # refuses unsupported types
        rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_hidden_layers:
            raise ValueError(f"qwen3_moe settings name {len(self.moe.sparse_layers)} layers' MLPs, the config has "
                             f"{self.num_hidden_layers} layers")

    @property
    def mixed_mlps(self) -> bool:
        """Dense MLP layers among sparse ones (qwen3_moe's mlp_only_layers / decoder_sparse_step)."""
        return self.moe is not None and len(set(self.moe.sparse_layers)) > 1

    @property
    def layer_matmul_params(self) -> int:
        """Weights every token is multiplied by in the decoder layers (q/k/v/o and the MLP; not the embedding
        or the LM head), for FLOP counts."""
        attention = decoder_layer_params(self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                                         self.head_dim, intermediate=0)
        if self.moe is None:
            return self.num_hidden_layers * (attention + 3 * self.hidden_size * self.intermediate_size)
        # Only the k routed experts a token reaches count (design §8.5).
        return sum(attention + mlp for mlp in self.moe.active_mlp_params(self.hidden_size, self.intermediate_size))

    @property
    def attention_layers(self) -> int:
        """Layers with softmax attention over the sequence (all of them)."""
        return self.num_hidden_layers

    @classmethod
    def from_hf(cls, config: Mapping) -> Qwen3Config:
        """From a Hugging Face config.json dict. Absent optional fields take transformers' `Qwen3Config`
        defaults (notably head_dim=128 and rope_theta=1e4, as transformers itself does)."""
        missing = [name for name in _REQUIRED if config.get(name) is None]
        if missing:
            raise ValueError(f"Qwen3 config is missing required field(s): {', '.join(missing)}")
        # Features this port does not implement are refused rather than silently mis-modelled.
        if config.get("use_sliding_window"):
            raise ValueError("Qwen3 config field 'use_sliding_window' is true; sliding-window targets are not "
                             "supported")
        if config.get("attention_bias"):
            raise ValueError("Qwen3 config field 'attention_bias' is true; Qwen3 attention has no biases")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3 config field 'hidden_act' must be 'silu', got {config['hidden_act']!r}")
        # transformers v5 nests RoPE settings in `rope_parameters`; older files have top-level keys.
        rope = config.get("rope_parameters")
        if rope is not None:
            if not isinstance(rope, Mapping):
                raise ValueError(f"Qwen3 config field 'rope_parameters' must be an object, got {rope!r}")
            theta = rope.get("rope_theta", 10000.0)
            scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
        else:
            theta, scaling = config.get("rope_theta", 10000.0), config.get("rope_scaling")
        if scaling is not None and dict(scaling) in ({}, {"rope_type": "default"}, {"type": "default"}):
            scaling = None
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or 128, rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            moe=(MoeSettings.from_qwen3_moe(config, config["num_hidden_layers"])
                 if config.get("model_type") == "qwen3_moe" else None))


class MlpStacks(NamedTuple):
    """`Qwen3.dense_mlps` and `sparse_mlps` split into graph and stacked state, and per layer (sparse, index in
    its stack); calling it with one layer's choice gives that layer's MLP."""

    dense_graph: nnx.GraphDef
    dense_state: nnx.State
    sparse_graph: nnx.GraphDef
    sparse_state: nnx.State
    choices: tuple[jax.Array, jax.Array]  # [L] bool, [L] int32

    def __call__(self, sparse: jax.Array, index: jax.Array):
        def run(graph, state, x):
            return nnx.merge(graph, jax.tree.map(lambda a: a[index], state))(x)

        return lambda x: jax.lax.cond(sparse, lambda x: run(self.sparse_graph, self.sparse_state, x),
                                      lambda x: run(self.dense_graph, self.dense_state, x), x)


class KVCache(NamedTuple):
    """The decode cache of `Qwen3.__call__`: keys/values of every layer at fixed-size columns (see
    `target.AttentionCache`). Columns 0..length-1 hold the tokens fed so far; later columns may hold stale
    entries of a cropped verification block (`cache._replace(length=n)`), overwritten before they are seen."""

    keys: jax.Array  # [L, b, capacity, kv_heads, head_dim]
    values: jax.Array  # [L, b, capacity, kv_heads, head_dim]
    segment_ids: jax.Array  # [b, capacity] int32, NO_SEGMENT where nothing was written
    length: jax.Array  # int32 scalar


class Attention(nnx.Module):
    """Qwen3Attention: per-head RMSNorm on q and k before RoPE, GQA, scale head_dim^-0.5, no biases."""

    def __init__(self, config: Qwen3Config, *, param_dtype, rngs: nnx.Rngs, attention_impl: str, mesh: Mesh | None):
        hidden, dim = config.hidden_size, config.head_dim
        self.q_heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, dim
        self.attention_impl, self.mesh = attention_impl, mesh
        self.q_proj = Linear(hidden, self.q_heads * dim, axes=("embed", "q_heads"), rngs=rngs,
                             param_dtype=param_dtype)
        self.k_proj = Linear(hidden, self.kv_heads * dim, axes=("embed", "kv_heads"), rngs=rngs,
                             param_dtype=param_dtype)
        self.v_proj = Linear(hidden, self.kv_heads * dim, axes=("embed", "kv_heads"), rngs=rngs,
                             param_dtype=param_dtype)
        self.o_proj = Linear(self.q_heads * dim, hidden, axes=("q_heads", "embed"), rngs=rngs,
                             param_dtype=param_dtype)
        self.q_norm = RMSNorm(dim, eps=config.rms_norm_eps, axis_name="head_dim", param_dtype=param_dtype)
        self.k_norm = RMSNorm(dim, eps=config.rms_norm_eps, axis_name="head_dim", param_dtype=param_dtype)

    def __call__(self, x, positions, segment_ids, inv_freq, cache: AttentionCache | None = None):
        batch, length, _ = x.shape
        q = self.q_norm(constrain(self.q_proj(x).reshape(batch, length, self.q_heads, self.head_dim), ROWS_HEADS))
        k = self.k_norm(constrain(self.k_proj(x).reshape(batch, length, self.kv_heads, self.head_dim), ROWS_KV_HEADS))
        v = constrain(self.v_proj(x).reshape(batch, length, self.kv_heads, self.head_dim), ROWS_KV_HEADS)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out, cache = causal_self_attention(q, k, v, segment_ids, self.head_dim**-0.5, self.attention_impl, self.mesh,
                                           cache)
        out = constrain(out, ROWS_HEADS).reshape(batch, length, self.q_heads * self.head_dim)
        return constrain(self.o_proj(out), ROWS_EMBED), cache


def feed_forward(config: Qwen3Config, sparse: bool, *, param_dtype, rngs: nnx.Rngs) -> nnx.Module:
    """A layer's MLP: routed experts (`SparseMoE`) or the dense SwiGLU of `intermediate_size`."""
    moe = config.moe
    if sparse:
        return SparseMoE(config.hidden_size, moe.expert_intermediate_size, moe.num_experts, moe.top_k,
                         moe.normalize_top_k, rngs=rngs, param_dtype=param_dtype)
    return MLP(config.hidden_size, config.intermediate_size, rngs=rngs, param_dtype=param_dtype)


def stacked(make, count: int, rngs: nnx.Rngs) -> nnx.Module:
    """`count` modules made by make(rngs), their variables stacked on a leading `layers` axis."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_stack(stack_rngs):
        return make(stack_rngs)

    return make_stack(rngs)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x += attn(norm(x)); x += mlp(norm(x)). With dense layers among sparse ones
    (`Qwen3Config.mixed_mlps`) the layer holds no MLP: its caller passes the one it runs (`Qwen3.__call__`)."""

    def __init__(self, config: Qwen3Config, *, param_dtype, rngs: nnx.Rngs, attention_impl: str, mesh: Mesh | None):
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps=eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, param_dtype=param_dtype, rngs=rngs, attention_impl=attention_impl,
                                   mesh=mesh)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, param_dtype=param_dtype)
        if not config.mixed_mlps:
            sparse = config.moe is not None and config.moe.sparse_layers[0]  # every layer alike
            self.mlp = feed_forward(config, sparse, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, segment_ids, inv_freq, cache: AttentionCache | None = None, mlp=None):
        attn, cache = self.self_attn(self.input_layernorm(x), positions, segment_ids, inv_freq, cache)
        x = x + attn
        return x + (self.mlp if mlp is None else mlp)(self.post_attention_layernorm(x)), cache


class Qwen3(EmbeddingAndHead, nnx.Module):
    """Qwen3ForCausalLM. `layers` holds all decoder layers stacked on a leading `layers` axis. With dense MLP
    layers among sparse ones (`Qwen3Config.mixed_mlps`), the MLPs are two stacks of their own, `dense_mlps` over
    the dense layers and `sparse_mlps` over the sparse ones (in layer order), and each step of the one scan over
    the layers runs its layer's MLP from one of them (`lax.cond`): compile time stays that of one layer, and
    each weight is stored once.

    attention_impl: the backend of `__call__`'s attention, "xla" (query chunks), "splash" (the TPU kernel; the
    Pallas interpreter elsewhere) or "auto" (splash on TPU, else xla; ops/backends.py). mesh: the device mesh
    the activations are sharded on, where splash runs per shard (None: one device).
    """

    def __init__(self, config: Qwen3Config, *, param_dtype=jnp.float32, rngs: nnx.Rngs, attention_impl: str = "xla",
                 mesh: Mesh | None = None):
        self.config = config
        attention_impl = resolve_attention_impl(attention_impl)
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, rngs=rngs, param_dtype=param_dtype)

        self.layers = stacked(lambda layer_rngs: DecoderLayer(config, param_dtype=param_dtype, rngs=layer_rngs,
                                                              attention_impl=attention_impl, mesh=mesh),
                              config.num_hidden_layers, rngs)
        if config.mixed_mlps:
            sparse = config.moe.sparse_layers
            for name, kind in (("dense_mlps", False), ("sparse_mlps", True)):
                setattr(self, name, stacked(lambda mlp_rngs: feed_forward(config, kind, param_dtype=param_dtype,
                                                                          rngs=mlp_rngs), sparse.count(kind), rngs))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, axes=("embed", "vocab"), rngs=rngs,
                                  param_dtype=param_dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 feature_layer_ids: tuple[int, ...] = (), cache: KVCache | None = None,
                 keep_every_state: bool = False, tree: jax.Array | None = None) -> TargetOutput:
        """input_ids, positions, segment_ids: [B, T] (positions restart in each packed document).

        features[:, :, i] is the residual stream right after decoder layer feature_layer_ids[i]
        (transformers `hidden_states[id + 1]`, except that HF's last entry is already final-normed).

        With a decode cache (`init_cache`), the tokens continue what the cache holds: they are written at
        columns cache.length.. and attend to the earlier columns of their segment, and `.cache` of the
        output is the grown cache. The same layers compute both, so a cached call gives what the uncached
        call over all tokens fed so far gives for these ones. The caller keeps cache.length + T <= capacity
        (XLA clamps a write past the end onto earlier columns). keep_every_state: accepted for the targets'
        common interface (`Qwen3_5`); a K/V cache can always be cut back with `keep_prefix`. tree [B, T, T]
        (with a cache): the tokens are a draft tree, each seeing the cached columns and its own ancestors
        (`target.AttentionCache.tree`; positions are the caller's, by depth); `keep_path` then keeps one path.
        """
        del keep_every_state
        wanted, slot, order = feature_slots(feature_layer_ids, self.config.num_hidden_layers)
        x = constrain(self.embed(input_ids), ROWS_EMBED)
        inv_freq = rope_frequencies(self.config.head_dim, self.config.rope_theta, self.config.rope_scaling,
                                    self.config.max_position_embeddings)
        buffer = constrain(jnp.zeros((len(wanted) + 1, *x.shape), x.dtype), (None, *ROWS_EMBED))
        if cache is not None:
            start = cache.length
            cache = cache._replace(segment_ids=write_columns(cache.segment_ids, segment_ids, start))
        layer_kv = None if cache is None else (cache.keys, cache.values)
        mlps = self._mlp_stacks()

        # Tree mode: the layers are a plain pytree here, so this also works when a caller's `jax.jit`
        # closes over the model (graph mode refuses variables from an outer trace).
        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0, 0), out_axes=(nnx.Carry, 0), graph=False)
        def run_layer(carry, layer, layer_slot, kv, mlp_choice):
            hidden, features = carry
            layer_cache = None if kv is None else AttentionCache(*kv, cache.segment_ids, start, tree)
            mlp = None if mlp_choice is None else mlps(*mlp_choice)
            hidden, layer_cache = layer(hidden, positions, segment_ids, inv_freq, layer_cache, mlp)
            hidden = constrain(hidden, ROWS_EMBED)
            features = jax.lax.dynamic_update_index_in_dim(features, hidden, layer_slot, axis=0)
            return (hidden, features), None if layer_cache is None else (layer_cache.keys, layer_cache.values)

        (x, buffer), layer_kv = run_layer((x, buffer), self.layers, jnp.asarray(slot), layer_kv,
                                          None if mlps is None else mlps.choices)
        if cache is not None:
            cache = KVCache(*layer_kv, cache.segment_ids, start + input_ids.shape[1])
        return TargetOutput(hidden=self.norm(x), features=jnp.moveaxis(buffer[order], 0, 2), cache=cache)

    def _mlp_stacks(self) -> MlpStacks | None:
        """With dense layers among sparse ones, the two MLP stacks and each layer's choice among them."""
        if not self.config.mixed_mlps:
            return None
        sparse = np.array(self.config.moe.sparse_layers)
        index = np.where(sparse, np.cumsum(sparse) - 1, np.cumsum(~sparse) - 1)  # the layer's place in its stack
        return MlpStacks(*nnx.split(self.dense_mlps), *nnx.split(self.sparse_mlps),
                         (jnp.asarray(sparse), jnp.asarray(index, jnp.int32)))

    def keep_prefix(self, cache: KVCache, length: jax.Array) -> KVCache:
        """The cache cut back to its first `length` columns; the columns after stay as stale entries that no
        later token sees and the next call overwrites."""
        return cache._replace(length=jnp.asarray(length, jnp.int32))

    def keep_path(self, cache: KVCache, start: jax.Array, path: jax.Array, length: jax.Array) -> KVCache:
        """After a tree call of T tokens at columns start..: its tokens path[0], path[1], ... ([T] indices into
        the call, a root-to-node path first) moved to columns start, start+1, ..., and the cache cut back to
        `length`. Their keys were rotated by depth, which is now their column's position (design §9.4)."""
        return cache._replace(keys=move_columns(cache.keys, start, path, axis=2),
                              values=move_columns(cache.values, start, path, axis=2),
                              length=jnp.asarray(length, jnp.int32))

    def init_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        """An empty decode cache of `capacity` columns per row (dtype: the weights' dtype unless given)."""
        config = self.config
        dtype = dtype or self.embed_tokens.embedding[...].dtype
        shape = (config.num_hidden_layers, batch, capacity, config.num_key_value_heads, config.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.full((batch, capacity), NO_SEGMENT, jnp.int32),
                       jnp.zeros((), jnp.int32))
