"""Gated DeltaNet, the linear-attention mixer of Qwen3.5/3.6 (transformers `Qwen3_5GatedDeltaNet` in
models/qwen3_5/modeling_qwen3_5.py; math in design §8.3).

x → in_proj_qkv → causal depthwise conv (K=4) + SiLU → q, k, v heads (held here as in_proj_q/k/v and
conv1d_q/k/v, the row blocks of HF's fused in_proj_qkv and conv1d: each splits on its own heads, so tensor
parallelism over heads never reshuffles channels between q, k and v); q, k L2-normalised (eps added to Σx²),
q scaled by dk^-0.5, key heads repeat-interleaved onto value heads; β = sigmoid(in_proj_b x);
g = −exp(A_log)·softplus(in_proj_a x + dt_bias) in fp32; gated delta rule (fp32 state; its chunk products in the
layer's `delta_rule_dtype`, fp32 by default); per-head RMSNorm (plain w)
gated by silu(in_proj_z x); out_proj. Conv and recurrent state restart at every packed-segment boundary.
Decoding carries the conv's last K−1 inputs and the recurrent state from call to call (`RecurrentCache`);
a verification call (a block, or a draft tree) keeps them after every one of its tokens, each token following
only its own path, so that the accepted token's entry can be picked (design §9.3, §9.4).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.layers import Linear, param
from dflash_jax.models.target import NO_SEGMENT
from dflash_jax.ops.context_parallel import gated_delta_rule_over_context, on_row_shards, previous_tail
from dflash_jax.ops.gated_delta import MATMUL_DTYPES, chunked_gated_delta_rule, segment_starts
from dflash_jax.sharding import CONTEXT_AXIS, ROWS_EMBED, ROWS_HEADS, constrain, context_shards

_L2_EPS = 1e-6  # transformers `l2norm` default, added to the sum of squares


class RecurrentCache(NamedTuple):
    """One Gated DeltaNet layer's part of a decode cache during a call (see `Qwen3_5.init_cache`)."""

    conv_inputs: jax.Array  # [b, K−1, C]: the conv's inputs at the K−1 tokens before this call
    state: jax.Array  # [b, value heads, dk, dv] fp32: the recurrent state after them
    history_segments: jax.Array  # [b, K−1]: those tokens' segments (NO_SEGMENT where there was none)


def states_along(seen: jax.Array, q, k, v, g, beta, resets, initial_state, matmul_dtype: str = "float32"
                 ) -> tuple[jax.Array, jax.Array]:
    """(out [B, T, H, dv], the recurrent state after each token [B, T, H, dk, dv]) of a short call whose
    token t follows only the call's tokens seen[:, t] (its prefix, or its ancestors in a draft tree; each
    before t, t itself included).

    The state after token t is the gated delta rule over the call with every token outside seen[:, t] made an
    identity step (g = β = 0 leaves S unchanged, the padding of `chunked_gated_delta_rule`), so all T runs are
    one batched call of the same chunked form the other calls use: T times a verification's recurrent work,
    which is small beside its projections (design §9.3)."""

    def run(kept):  # kept [B, T]: the tokens this run follows
        return chunked_gated_delta_rule(q, k, v, jnp.where(kept[..., None], g, 0.0),
                                        jnp.where(kept[..., None], beta, 0.0), resets & kept, initial_state,
                                        matmul_dtype=matmul_dtype)

    outs, states = jax.vmap(run, in_axes=1)(seen)  # [T runs, B, T, ...], [T runs, B, H, dk, dv]
    length = seen.shape[1]
    out = outs[jnp.arange(length), :, jnp.arange(length)]  # run t's output at token t: [T, B, H, dv]
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(states, 0, 1)


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, S, ...] at index [B, ...] along axis 1, per row b."""
    rows = jnp.arange(x.shape[0]).reshape(-1, *([1] * (index.ndim - 1)))
    return x[rows, index]


def conv_windows(seen: jax.Array, kernel_size: int) -> jax.Array:
    """[B, T, K] indices into [the K−1 cached inputs | the call's T inputs]: the inputs token t's conv reads,
    oldest first, itself last, following seen[:, t] (see `states_along`) back into the cached ones."""
    depth = jnp.sum(seen, axis=-1) - 1  # [B, T]: how many of the call's tokens come before t on its path
    wanted = depth[..., None] - jnp.arange(kernel_size - 1, -1, -1)  # [B, T, K]: the depth of each tap
    on_path = seen[:, :, None, :] & (depth[:, None, None, :] == wanted[..., None])  # [B, T, K, T]
    return kernel_size - 1 + jnp.where(wanted >= 0, jnp.argmax(on_path, axis=-1), wanted)


class CausalDepthwiseConv(nnx.Module):
    """out[t, c] = Σ_j weight[c, j] · x[t − (K−1) + j, c], reading only earlier tokens of the same segment.

    weight is [channels, K] (HF's [C, 1, K] squeezed); weight[:, K−1] multiplies the current token. No bias.
    Decoding passes the K−1 earlier inputs and their segments as `history`; otherwise the sequence starts
    at x (zero left padding).
    """

    def __init__(self, channels: int, kernel_size: int, *, axis: str, rngs: nnx.Rngs, param_dtype=jnp.float32):
        init = jax.random.normal(rngs.params(), (channels, kernel_size), param_dtype) * kernel_size**-0.5
        self.weight = param(init, (axis, "conv"))

    def over_windows(self, inputs: jax.Array, windows: jax.Array, visible: jax.Array) -> jax.Array:
        """out[b, t] = Σ_j weight[:, j] · inputs[b, windows[b, t, j]] where visible[b, t, j]; inputs [B, S, C],
        windows and visible [B, T, K] (`conv_windows`). Accumulates in fp32, returns the weight dtype."""
        taps = _gather_rows(inputs.astype(jnp.float32), windows)  # [B, T, K, C]
        taps = jnp.where(visible[..., None], taps, 0.0)
        return jnp.einsum("btkc,ck->btc", taps, self.weight[...].astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST).astype(self.weight.dtype)

    def __call__(self, x: jax.Array, segment_ids: jax.Array,
                 history: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """x: [B, T, C]; segment_ids: [B, T]; history: ([B, K−1, C], [B, K−1]) or None. Accumulates in fp32,
        returns [B, T, C] in the weight dtype."""
        if history is not None:
            x = jnp.concatenate([history[0].astype(x.dtype), x], axis=1)
            segment_ids = jnp.concatenate([history[1], segment_ids], axis=1)
        weight = self.weight[...].astype(jnp.float32)
        kernel_size, length = weight.shape[1], x.shape[1]
        x32 = x.astype(jnp.float32)
        out = x32 * weight[:, kernel_size - 1]
        for shift in range(1, min(kernel_size, length)):
            # Token t reads token t − shift only when both lie in the same segment: the zero left padding
            # of a fresh sequence, applied at every document start.
            same = segment_ids[:, shift:] == segment_ids[:, :-shift]
            earlier = jnp.where(same[..., None], x32[:, :-shift], 0.0)
            out = out + jnp.pad(earlier, ((0, 0), (shift, 0), (0, 0))) * weight[:, kernel_size - 1 - shift]
        if history is not None:
            out = out[:, history[0].shape[1]:]
        return out.astype(self.weight.dtype)

    def over_row_shards(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """`__call__` on rows whose tokens are split over the mesh's context axis (design §19): each shard reads
        the K−1 inputs before its first token from the previous shard, as decoding reads its history."""
        width = self.weight.shape[1] - 1

        def shard(x, segment_ids):
            history = (previous_tail(x, width, CONTEXT_AXIS, 0), previous_tail(segment_ids, width, CONTEXT_AXIS,
                                                                                NO_SEGMENT))
            return self(x, segment_ids, history)

        return on_row_shards(shard, x, segment_ids)


class GatedRMSNorm(nnx.Module):
    """transformers `Qwen3_5RMSNormGated`: w · x̂ (x̂ in fp32, cast back before the plain-w multiply), then
    · silu(z) in fp32, over the last axis (one value head). The weight starts at 1 and is shared by heads."""

    def __init__(self, features: int, *, eps: float, param_dtype=jnp.float32):
        self.weight = param(jnp.ones((features,), param_dtype), ("head_dim",))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        scaled = self.weight[...].astype(x.dtype) * normed
        return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def _l2_normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


class GatedDeltaNet(nnx.Module):
    """Linear-attention mixer. Projections are stored [in, out]; names follow the HF checkpoint, the fused q|k|v
    projection and its conv split into their q, k and v parts (weights/hf_qwen3_5.py splits the tensors).
    delta_rule_dtype: the gated delta rule's chunk products, "float32" (exact) or "bfloat16" (ops/gated_delta.py)."""

    def __init__(self, hidden_size: int, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel_size: int, rms_norm_eps: float, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, delta_rule_dtype: str = "float32"):
        if delta_rule_dtype not in MATMUL_DTYPES:
            raise ValueError(f"delta_rule_dtype must be one of {MATMUL_DTYPES}, got {delta_rule_dtype!r}")
        self.delta_rule_dtype = delta_rule_dtype
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        linear = lambda n_in, n_out, axes: Linear(n_in, n_out, axes=axes, rngs=rngs, param_dtype=param_dtype)
        self.in_proj_q = linear(hidden_size, key_dim, ("embed", "linear_key"))
        self.in_proj_k = linear(hidden_size, key_dim, ("embed", "linear_key"))
        self.in_proj_v = linear(hidden_size, value_dim, ("embed", "linear_value"))
        self.in_proj_z = linear(hidden_size, value_dim, ("embed", "linear_value"))
        self.in_proj_b = linear(hidden_size, num_value_heads, ("embed", "linear_heads"))
        self.in_proj_a = linear(hidden_size, num_value_heads, ("embed", "linear_heads"))
        conv = lambda channels, axis: CausalDepthwiseConv(channels, conv_kernel_size, axis=axis, rngs=rngs,
                                                          param_dtype=param_dtype)
        self.conv1d_q, self.conv1d_k = conv(key_dim, "linear_key"), conv(key_dim, "linear_key")
        self.conv1d_v = conv(value_dim, "linear_value")
        # The decay parameters stay fp32 whatever the model dtype (HF upcasts A_log; dt_bias enters the fp32
        # softplus). Initial values as transformers: dt_bias = 1, A = exp(A_log) ~ U(1, 16).
        self.dt_bias = param(jnp.ones((num_value_heads,), jnp.float32), ("linear_heads",))
        decay_rate = jax.random.uniform(rngs.params(), (num_value_heads,), jnp.float32, 1.0, 16.0)
        self.A_log = param(jnp.log(decay_rate), ("linear_heads",))
        self.norm = GatedRMSNorm(value_head_dim, eps=rms_norm_eps, param_dtype=param_dtype)
        self.out_proj = linear(value_dim, hidden_size, ("linear_value", "embed"))

    def __call__(self, x: jax.Array, segment_ids: jax.Array, cache: RecurrentCache | None = None,
                 seen: jax.Array | None = None) -> tuple[jax.Array, RecurrentCache | None]:
        """x: [B, T, hidden] (already input-normed); segment_ids: [B, T]. Returns ([B, T, hidden], the cache
        after these tokens, or None without one). seen [B, T, T] (with a cache): token t follows only the
        call's tokens seen[:, t] (its prefix, or its ancestors in a draft tree), and the returned cache holds
        per token the conv inputs of the K−1 tokens up to it ([B, T, K−1, C]) and the state after it
        ([B, T, H, dk, dv]), for `Qwen3_5.keep_prefix` / `keep_path` to pick one."""
        batch, length, _ = x.shape
        key_dim = self.num_key_heads * self.key_head_dim
        convs = (self.conv1d_q, self.conv1d_k, self.conv1d_v)
        conv_inputs = (self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x))
        split_row = cache is None and context_shards() > 1  # a row over several devices (design §19)
        if cache is None:
            mixed = [conv.over_row_shards(inputs, segment_ids) if split_row else conv(inputs, segment_ids)
                     for conv, inputs in zip(convs, conv_inputs)]
            resets, initial_state = segment_starts(segment_ids), None
        else:  # the cache holds the conv inputs as HF's fused q|k|v channels
            histories = jnp.split(cache.conv_inputs, [key_dim, 2 * key_dim], axis=-1)
            if seen is None:
                mixed = [conv(inputs, segment_ids, (history, cache.history_segments))
                         for conv, inputs, history in zip(convs, conv_inputs, histories)]
            else:  # each token's conv reads the inputs along its own path
                windows = conv_windows(seen, self.conv1d_q.weight.shape[1])
                segments = jnp.concatenate([cache.history_segments, segment_ids], axis=1)
                visible = _gather_rows(segments, windows) == segment_ids[..., None]
                mixed = [conv.over_windows(jnp.concatenate([history.astype(inputs.dtype), inputs], axis=1),
                                           windows, visible)
                         for conv, inputs, history in zip(convs, conv_inputs, histories)]
            # The first token continues the cached state iff it continues the last cached token's segment.
            previous = jnp.concatenate([cache.history_segments[:, -1:], segment_ids[:, :-1]], axis=1)
            # Right padding of a fixed-width call (segment NO_SEGMENT) must leave the state as the text left
            # it: g = β = 0 there make identity steps, and it neither resets nor enters the conv history.
            padding = segment_ids == NO_SEGMENT
            resets, initial_state = (segment_ids != previous) & ~padding, cache.state
        q, k, v = (jax.nn.silu(m).reshape(batch, length, -1, dim) for m, dim in
                   zip(mixed, (self.key_head_dim, self.key_head_dim, self.value_head_dim)))
        # Value head j reads key head j // r (repeat_interleave, not tile).
        ratio = self.num_value_heads // self.num_key_heads
        q = jnp.repeat(_l2_normalize(q) * np.float32(self.key_head_dim**-0.5), ratio, axis=2)
        k = jnp.repeat(_l2_normalize(k), ratio, axis=2)

        beta = jax.nn.sigmoid(self.in_proj_b(x))  # in the model dtype, as HF
        a = self.in_proj_a(x).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...])  # log-decay ≤ 0, fp32
        if cache is not None:
            g, beta = jnp.where(padding[..., None], 0.0, g), jnp.where(padding[..., None], 0.0, beta)

        q, k, v = (constrain(t, ROWS_HEADS) for t in (q, k, v))
        if split_row:
            rule = functools.partial(gated_delta_rule_over_context, axis=CONTEXT_AXIS,
                                     matmul_dtype=self.delta_rule_dtype)
            out, state = on_row_shards(rule, q, k, v, g, beta, resets), None
        elif seen is None:
            out, state = chunked_gated_delta_rule(q, k, v, g, beta, resets, initial_state,
                                                  matmul_dtype=self.delta_rule_dtype)
        else:
            out, state = states_along(seen, q, k, v, g, beta, resets, initial_state, self.delta_rule_dtype)
        if cache is not None:
            kept = cache.conv_inputs.shape[1]
            fused = jnp.concatenate(conv_inputs, axis=-1).astype(cache.conv_inputs.dtype)
            history = jnp.concatenate([cache.conv_inputs, fused], axis=1)
            if seen is None:  # the K−1 inputs up to the last text token of each row
                text_end = jnp.sum(~padding, axis=1)[:, None, None] + jnp.arange(kept)[None, :, None]
                history = jnp.take_along_axis(history, text_end, axis=1)
            else:  # per token, the K−1 inputs up to it along its path: [B, T, K−1, C]
                history = _gather_rows(history, windows[..., 1:])
            cache = cache._replace(conv_inputs=history, state=state)
        z = constrain(self.in_proj_z(x).reshape(batch, length, self.num_value_heads, self.value_head_dim), ROWS_HEADS)
        out = self.norm(constrain(out.astype(x.dtype), ROWS_HEADS), z)
        out = self.out_proj(out.reshape(batch, length, self.num_value_heads * self.value_head_dim))
        return constrain(out, ROWS_EMBED), cache
