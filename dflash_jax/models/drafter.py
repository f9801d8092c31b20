"""The DFlash drafter (design §3): Qwen3 decoder layers whose keys/values also cover the fused target context.

ctx = hidden_norm(fc(concat of the n target feature layers)) is computed once and feeds every layer's own
k_proj/v_proj (never input_layernorm). Queries are the block tokens only; the mask is design §5. The drafter
owns no embedding or LM head: the caller embeds block ids and applies lm_head with the frozen target's.

One forward serves training, exact τ and decoding (the Flax gemma pattern): without a cache the blocks of
whole rows attend to the rows' context on the anchor grid; with a cache (`init_cache`), each decoding step
appends the newly verified context's keys/values and drafts one block over the cached columns. Only the
attention mask and kernel differ (`Attend`); projections, norms, RoPE and the layer step are shared.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from dflash_jax.methods import DrafterMethod, METHODS, method_for
from dflash_jax.models import dflash2
from dflash_jax.models.dflash2 import BlockConvolution, CandidateSelector, convolved
from dflash_jax.models.drafter_cache import DrafterCache, empty_cache, ring_positions, write_columns, write_ring
from dflash_jax.models.dspark_heads import ConfidenceHead, MarkovHead
from dflash_jax.models.layers import (MLP, Linear, RMSNorm, apply_rope, decoder_layer_params,
                                      rope_frequencies)
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.ops.anchors import AnchorGrid, DrafterInputs, check_block_size
from dflash_jax.ops.dflash_attention import cached_dflash_attention, dflash_attention
from dflash_jax.ops.splash_attention import dflash_attention_splash
from dflash_jax.sharding import ROWS_EMBED, ROWS_HEADS, ROWS_KV_HEADS, constrain

LAYER_TYPES = ("full_attention", "sliding_attention")
# The drafter family members that build (design §18): the DFlash backbone alone, with DSpark's heads, or with
# DFlash2's convolutions and candidate selector.
BUILT_METHODS = tuple(METHODS)
# Rematerialisation of each drafter layer in training (jax.checkpoint per layer, design §13): what its forward
# keeps for the backward.
REMAT_POLICIES = {
    "none": None,  # no checkpoint: every intermediate stays until the backward
    "full": jax.checkpoint_policies.nothing_saveable,  # only the layer's input; the backward reruns the layer
    # the weight matmuls' outputs (projections, MLP); norms, activations and attention are recomputed
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the attention output; projections and the MLP are recomputed, the attention itself is not
    "attention": jax.checkpoint_policies.save_only_these_names("attention_out"),
}


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """design §2: round(1 + i*(L-4)/(n-1)) for i < n (Python round, half to even), or (L//2,) when n = 1."""
    if n < 1:
        raise ValueError(f"the number of feature layers must be >= 1, got {n}")
    if n == 1:
        return (num_target_layers // 2,)
    return tuple(round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    """Architecture of a drafter: everything the z-lab export's config.json records (design §10)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    vocab_size: int
    max_position_embeddings: int
    # design §18: "dspark" adds the Markov bias of rank markov_rank (0 for "dflash": no head) and the
    # confidence head. Defaults keep the drafter_config.json of earlier dflash runs readable.
    method: str = "dflash"
    markov_rank: int = 0
    # design §18.4: "dflash2"'s convolution taps K and channels per dynamic kernel group, and its selector's rank
    # and candidates (0 for the other methods: no such parts).
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    def __post_init__(self):
        # JSON configs give lists; keep tuples so the config stays immutable and comparable.
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_target_layers", "vocab_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DrafterConfig.{name} must be a positive int, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"DrafterConfig.{name} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DrafterConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of DrafterConfig.num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"DrafterConfig.head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"DrafterConfig.layer_types has {len(self.layer_types)} entries, expected "
                             f"num_hidden_layers = {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"DrafterConfig.layer_types has unknown types {unknown}; allowed: {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and (
                not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"DrafterConfig.sliding_window must be a positive int when layer_types has a "
                             f"sliding_attention layer, got {self.sliding_window!r}")
        check_block_size(self.block_size, "DrafterConfig.block_size")
        if not self.target_layer_ids:
            raise ValueError("DrafterConfig.target_layer_ids must name at least one target layer")
        out_of_range = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if out_of_range:
            raise ValueError(f"DrafterConfig.target_layer_ids {list(self.target_layer_ids)} has ids "
                             f"{out_of_range} outside [0, num_target_layers-1 = {self.num_target_layers - 1}]")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DrafterConfig.mask_token_id ({self.mask_token_id}) must lie in "
                             f"[0, vocab_size = {self.vocab_size})")
        if self.method not in BUILT_METHODS:
            raise ValueError(f"DrafterConfig.method must be one of {BUILT_METHODS}, got {self.method!r}")
        if self.drafter_method.has_markov_head != (isinstance(self.markov_rank, int) and self.markov_rank >= 1):
            raise ValueError(f"DrafterConfig.markov_rank must be a positive int for method 'dspark' and 0 otherwise, "
                             f"got {self.markov_rank!r} for method {self.method!r}")
        for error in dflash2.config_errors(self):
            raise ValueError(f"DrafterConfig.{error}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"DrafterConfig.rope_scaling must be None or a dict, got {self.rope_scaling!r}")

    def __hash__(self):
        # rope_scaling is a dict; hash the whole config through a canonical JSON form (NNX graph defs that
        # hold the config must be hashable for jit caching).
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    @property
    def layer_matmul_params(self) -> int:
        """Weights every block token is multiplied by in the decoder layers (q/k/v/o, the MLP and DFlash2's two
        kernel projections [H, 2·K·G]; not fc), for FLOP counts."""
        projections = 2 * self.hidden_size * 2 * self.conv_kernel_size * (
            self.hidden_size // self.conv_group_size if self.conv_group_size else 0)
        return self.num_hidden_layers * (projections + decoder_layer_params(
            self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
            self.intermediate_size))

    @property
    def draft_length(self) -> int:
        """Tokens one block drafts: B for "dspark", whose every slot predicts the token after it (the anchor's
        slot included), B - 1 otherwise (slot 0 holds the bonus token; design §18)."""
        return self.drafter_method.draft_length(self.block_size)

    @property
    def drafter_method(self) -> DrafterMethod:
        """The method object of `method` (design §18), which the modules ask instead of comparing its name."""
        return method_for(self.method)

    def window(self, layer_index: int) -> int | None:
        """The attention window of a layer: W for sliding_attention, None (full attention) otherwise."""
        return self.sliding_window if self.layer_types[layer_index] == "sliding_attention" else None


class DecodeStep(NamedTuple):
    """Where one decoding step's inputs sit, one document per row (column = position): the new context
    features at positions context_start.., and the block at `anchor` (its bonus token, whose features do not
    exist yet)."""

    context_start: jax.Array  # int32 scalar
    anchor: jax.Array  # int32 scalar


# attend(q, k_ctx, v_ctx, k_blk, v_blk, window, scale) -> [b, queries, Hq, D]: the mask and kernel of one forward.
Attend = Callable[..., jax.Array]


class DrafterAttention(nnx.Module):
    """Block queries; keys/values over [context | block]; q_norm/k_norm before RoPE; the design §5 mask."""

    def __init__(self, config: DrafterConfig, window: int | None, *, rngs: nnx.Rngs, param_dtype, dtype):
        hidden, head_dim = config.hidden_size, config.head_dim
        q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        linear = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.q_proj = Linear(hidden, q_width, axes=("embed", "q_heads"), **linear)
        self.k_proj = Linear(hidden, kv_width, axes=("embed", "kv_heads"), **linear)
        self.v_proj = Linear(hidden, kv_width, axes=("embed", "kv_heads"), **linear)
        self.o_proj = Linear(q_width, hidden, axes=("q_heads", "embed"), **linear)
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, axis_name="head_dim", param_dtype=param_dtype)
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, axis_name="head_dim", param_dtype=param_dtype)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.window = window

    def _heads(self, x: jax.Array, num_heads: int) -> jax.Array:
        return constrain(x.reshape(*x.shape[:2], num_heads, self.head_dim),
                         ROWS_HEADS if num_heads == self.num_heads else ROWS_KV_HEADS)

    def key_values(self, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """k_norm/RoPE keys and values of x [b, t, H] at `positions`: of the context (every layer's own
        k_proj/v_proj on ctx, never input_layernorm) and of the block tokens alike."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), positions, inv_freq)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def __call__(self, h: jax.Array, context: tuple[jax.Array, jax.Array], block_positions: jax.Array,
                 attend: Attend, inv_freq: np.ndarray) -> jax.Array:
        q = apply_rope(self.q_norm(self._heads(self.q_proj(h), self.num_heads)), block_positions, inv_freq)
        k_blk, v_blk = self.key_values(h, block_positions, inv_freq)
        out = constrain(attend(q, *context, k_blk, v_blk, window=self.window, scale=self.head_dim**-0.5), ROWS_HEADS)
        out = checkpoint_name(out, "attention_out")  # what REMAT_POLICIES["attention"] keeps
        return constrain(self.o_proj(out.reshape(*out.shape[:2], self.num_heads * self.head_dim)), ROWS_EMBED)


class DrafterLayer(nnx.Module):
    """Pre-norm Qwen3 decoder layer over the block tokens; the context enters attention as keys/values. For
    method "dflash2" each sublayer's normed input and output pass its block convolution (design §18.4)."""

    def __init__(self, config: DrafterConfig, window: int | None, *, rngs: nnx.Rngs, param_dtype, dtype):
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps=eps, param_dtype=param_dtype)
        self.self_attn = DrafterAttention(config, window, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, param_dtype=param_dtype)
        self.mlp = MLP(hidden, config.intermediate_size, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        convolved_sublayers = config.drafter_method.has_block_convolution
        convolutions = [BlockConvolution(hidden, config.block_size, config.conv_kernel_size, config.conv_group_size,
                                         param_dtype=param_dtype, dtype=dtype) if convolved_sublayers
                        else None for _ in range(2)]
        self.attention_conv, self.mlp_conv = (nnx.data(convolution) for convolution in convolutions)

    def __call__(self, x, context, block_positions, attend: Attend, inv_freq: np.ndarray) -> jax.Array:
        def attention(h):
            return self.self_attn(h, context, block_positions, attend, inv_freq)

        x = x + convolved(self.attention_conv, attention, self.input_layernorm(x))
        return x + convolved(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))


class Drafter(nnx.Module):
    """fc + hidden_norm over the target features, the decoder layers, and the final norm (design §3); for
    method "dspark" also `markov_head` and `confidence_head` (design §18; None otherwise), for "dflash2" the
    layers' convolutions and `candidate_selector` (design §18.4).

    param_dtype: storage dtype of the weights (fp32 master weights by default); dtype: compute dtype
    (defaults to param_dtype). attention_impl picks the training forward's §5 attention backend: "xla",
    "splash", or "auto" (splash on TPU, else xla; ops/backends.py; "cudnn", the targets' GPU path, is xla
    here); query_chunk_blocks is the number of blocks per query chunk of the XLA backend (its memory knob);
    mesh is the device mesh the activations are sharded on, where splash runs per shard (None: one device).
    Decoding with a cache always runs in XLA.
    remat names the training forward's per-layer rematerialisation policy (REMAT_POLICIES).
    """

    def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None,
                 attention_impl: str = "xla", query_chunk_blocks: int = 32, mesh: Mesh | None = None,
                 remat: str = "none"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {list(REMAT_POLICIES)}, got {remat!r}")
        self.remat = remat
        # refuse a bad rope now
        rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
        dtype = param_dtype if dtype is None else dtype
        hidden = config.hidden_size
        self.config = config
        self.dtype = dtype
        self.attention_impl = resolve_attention_impl(attention_impl)
        self.query_chunk_blocks = query_chunk_blocks
        self.mesh = mesh
        self.fc = Linear(len(config.target_layer_ids) * hidden, hidden, axes=("fc_in", "embed"), rngs=rngs,
                         param_dtype=param_dtype, dtype=dtype)
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.layers = nnx.List([
            DrafterLayer(config, config.window(i), rngs=rngs, param_dtype=param_dtype, dtype=dtype)
            for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps, param_dtype=param_dtype)
        # DSpark's heads (design §18), built after the backbone so that its initialisation is the same for every
        # method. The drafter's forward never applies them: the loss adds the bias inside its LM-head chunks.
        dspark = config.drafter_method.has_markov_head
        self.markov_head = nnx.data(MarkovHead(config.vocab_size, config.vocab_size, config.markov_rank, rngs=rngs,
                                               param_dtype=param_dtype) if dspark else None)
        self.confidence_head = nnx.data(ConfidenceHead(hidden, config.markov_rank, rngs=rngs,
                                                       param_dtype=param_dtype) if dspark else None)
        # DFlash2's selector (design §18.4), applied by the loss and the decoders after the LM head.
        self.candidate_selector = nnx.data(CandidateSelector(
            config.vocab_size, hidden, config.selector_rank, config.selector_top_k, rngs=rngs,
            param_dtype=param_dtype, dtype=dtype) if config.drafter_method.has_block_convolution else None)

    def init_cache(self, batch: int, capacity: int) -> DrafterCache:
        """An empty decoding cache: `capacity` context columns per row in full-attention layers, the window's in
        sliding ones (models/drafter_cache.py)."""
        config = self.config
        return empty_cache([config.window(i) for i in range(config.num_hidden_layers)], batch, capacity,
                           config.num_key_value_heads, config.head_dim, self.dtype)

    def __call__(self, context_features: jax.Array, block_embeds: jax.Array, inputs: DrafterInputs | DecodeStep,
                 cache: DrafterCache | None = None) -> tuple[jax.Array, DrafterCache | None]:
        """(hidden states after the drafter's final norm, the input of the target's lm_head; the cache).

        context_features: [b, t, n*H], the target feature layers concatenated in target_layer_ids order;
        block_embeds: [b, queries, H], the target's embedding of the block ids.
        Without a cache (training, exact τ): t = T, a whole row; the blocks sit on `inputs.grid`
        (`DrafterInputs`), queries = N*B, hidden [b, N*B, H].
        With a cache (decoding, `DecodeStep`): the context of positions inputs.context_start.. is written
        into the cache first (a committed position's context is cached once; columns past the anchor may hold
        stale rows in full-attention layers, which stay invisible until overwritten); then the one block at
        inputs.anchor (queries = B) sees the cached columns before the anchor, by the same §5 rules. Returns the
        updated cache.
        """
        config = self.config
        inv_freq = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                    config.max_position_embeddings)
        if cache is None:
            self._check_shapes(context_features, block_embeds, inputs.grid)
            context_positions, block_positions = inputs.context_positions, inputs.block_positions
            attend = functools.partial(self._backend(), context_segment_ids=inputs.context_segment_ids,
                                       anchor_segment_ids=inputs.anchor_segment_ids, grid=inputs.grid)
        else:
            context_positions = _positions(inputs.context_start, context_features.shape[:2])
            block_positions = _positions(inputs.anchor, block_embeds.shape[:2])
        ctx = constrain(self.hidden_norm(self.fc(constrain(context_features, ROWS_EMBED))), ROWS_EMBED)
        x = constrain(block_embeds.astype(self.dtype), ROWS_EMBED)

        def layer_step(layer: DrafterLayer, x: jax.Array, context: tuple[jax.Array, jax.Array],
                       attend: Attend) -> jax.Array:
            return constrain(layer(x, context, block_positions, attend, inv_freq), ROWS_EMBED)

        if cache is None:
            def training_layer(layer: DrafterLayer, x: jax.Array) -> jax.Array:
                # One rematerialisation unit: the layer's context keys/values and its step.
                return layer_step(layer, x, layer.self_attn.key_values(ctx, context_positions, inv_freq), attend)

            if self.remat != "none":
                training_layer = nnx.remat(training_layer, policy=REMAT_POLICIES[self.remat])
            for layer in self.layers:
                x = training_layer(layer, x)
            return self.norm(x), None
        full, ring = ([], []), ([], [])  # the layers' updated (keys, values), in cache order
        start, anchor = inputs.context_start, inputs.anchor
        for layer in self.layers:
            new = layer.self_attn.key_values(ctx, context_positions, inv_freq)
            if layer.self_attn.window is None:
                index = len(full[0])
                context = tuple(write_columns(cached[index], n, start) for cached, n in zip(cache[:2], new))
                attend, written = functools.partial(cached_dflash_attention, anchor=anchor), full
            else:
                index = len(ring[0])
                context = tuple(write_ring(cached[index], n, start, anchor) for cached, n in zip(cache[2:], new))
                attend = functools.partial(cached_dflash_attention, anchor=anchor,
                                           key_positions=ring_positions(anchor, cache.window_keys.shape[2]))
                written = ring
            written[0].append(context[0])
            written[1].append(context[1])
            x = layer_step(layer, x, context, attend)
        stacked = [jnp.stack(arrays) if arrays else empty for arrays, empty in zip((*full, *ring), cache)]
        return self.norm(x), DrafterCache(*stacked)

    def _backend(self) -> Attend:
        """The training forward's attention: the §5 mask on the anchor grid, by attention_impl."""
        if self.attention_impl == "splash":
            return functools.partial(dflash_attention_splash, mesh=self.mesh)
        return functools.partial(dflash_attention, query_chunk_blocks=self.query_chunk_blocks)

    def _check_shapes(self, context_features: jax.Array, block_embeds: jax.Array, grid: AnchorGrid) -> None:
        config = self.config
        width = len(config.target_layer_ids) * config.hidden_size
        if context_features.shape[-1] != width:
            raise ValueError(f"context_features has width {context_features.shape[-1]}, expected n*H = "
                             f"{len(config.target_layer_ids)}*{config.hidden_size} = {width} (one hidden state per "
                             f"target_layer_ids entry {list(config.target_layer_ids)})")
        if grid.block_size != config.block_size:
            raise ValueError(f"grid.block_size ({grid.block_size}) differs from DrafterConfig.block_size "
                             f"({config.block_size})")
        if context_features.shape[1] != grid.seq_len or block_embeds.shape[1:] != (grid.num_queries,
                                                                                   config.hidden_size):
            raise ValueError(f"context_features {context_features.shape} and block_embeds {block_embeds.shape} "
                             f"do not fit {grid} with hidden_size {config.hidden_size}: expected [b, "
                             f"{grid.seq_len}, n*H] and [b, {grid.num_queries}, {config.hidden_size}]")


def _positions(start: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """[b, t] positions start, start+1, ... of every row."""
    return jnp.broadcast_to(start + jnp.arange(shape[1]), shape)
