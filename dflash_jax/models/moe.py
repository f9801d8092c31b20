"""Routed mixture-of-experts feed-forward block of the Qwen MoE targets (design §8.5), in Flax NNX.

Exactly what transformers computes (`Qwen3MoeSparseMoeBlock`, `Qwen3_5MoeSparseMoeBlock`): a linear router,
softmax over all experts in fp32, the top k per token (ties to the lower expert index; see `route`), the k
weights renormalised to sum 1 when `normalize`; every token reaches its k experts (no capacity limit, nothing
dropped). Dispatch sorts the N*k (token, expert) assignments by expert and runs each SwiGLU projection as one
grouped matmul (`jax.lax.ragged_dot`; on CPU, expert-pure row tiles) over the sorted rows, so the work is
linear in tokens*k, never experts x tokens. Experts are stacked [E, ...] on a leading `expert` logical axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.layers import INIT_STD, MLP, Linear, param
from dflash_jax.ops.backends import compile_platform


def route(router_logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """router_logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k] int32).

    Softmax in fp32, then top k; `jax.lax.top_k` puts the lower index first among exactly equal probabilities.
    torch.topk on CPU follows no index rule among equal values, so only there can the chosen experts differ
    from transformers' (tests/models/test_moe.py)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(router_logits.dtype), experts.astype(jnp.int32)


_TILE_ROWS = 64  # rows per expert tile of the CPU dispatch (`_tiled_swiglu`)


def grouped_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array, *, tiled: bool | None = None) -> jax.Array:
    """sum over k of weights[n, k] * expert_{experts[n, k]}(x[n]), for x [N, H]; gate/up [E, H, I], down [E, I, H].

    The N*k assignments are sorted by expert (stable), so each expert's rows are contiguous; then either one
    `ragged_dot` per projection multiplies every row by its own expert's weights, or (tiled, the default on
    CPU, where XLA lowers ragged_dot to E dense products over all rows: measured 20x one dense product at
    E = 16, 90x at E = 64, design §8.5) `_tiled_swiglu` does the same products in expert-pure row tiles. The
    products return to their tokens by a scatter-add. Both are exact (the same per-row products)."""
    num_tokens, top_k = experts.shape
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    token_of_row = order // top_k  # assignment n*k + j belongs to token n
    group_sizes = jnp.bincount(flat_experts, length=gate.shape[0]).astype(jnp.int32)
    rows = x[token_of_row].astype(gate.dtype)
    if tiled if tiled is not None else compile_platform() == "cpu":
        out = _tiled_swiglu(rows, group_sizes, gate, up, down)
    else:
        hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes)) * jax.lax.ragged_dot(rows, up, group_sizes)
        out = jax.lax.ragged_dot(hidden, down, group_sizes)
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
    return jnp.zeros((num_tokens, x.shape[-1]), out.dtype).at[token_of_row].add(out).astype(x.dtype)


def _tiled_swiglu(rows: jax.Array, group_sizes: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:
    """SwiGLU of expert-sorted rows [R, H] (expert e's group_sizes[e] rows contiguous, in expert order).

    Each expert's rows are padded to a whole number of _TILE_ROWS-row tiles, so every tile belongs to one
    expert; a loop over the (at most R/_TILE_ROWS + E) tiles multiplies each by its expert's weights. Work is
    (R + E * _TILE_ROWS) rows, linear in tokens, and one expert's weights are live at a time."""
    num_rows, num_experts = rows.shape[0], gate.shape[0]
    num_tiles = -(-num_rows // _TILE_ROWS) + num_experts
    padded_sizes = -(-group_sizes // _TILE_ROWS) * _TILE_ROWS
    padded_ends = jnp.cumsum(padded_sizes)
    group_starts, padded_starts = jnp.cumsum(group_sizes) - group_sizes, padded_ends - padded_sizes
    expert_of_row = jnp.repeat(jnp.arange(num_experts), group_sizes, total_repeat_length=num_rows)
    padded_row = padded_starts[expert_of_row] + jnp.arange(num_rows) - group_starts[expert_of_row]
    tiles = jnp.zeros((num_tiles * _TILE_ROWS, rows.shape[1]), rows.dtype).at[padded_row].set(rows)
    # A tile past the last expert's rows holds zeros; it is computed with the last expert and never read.
    tile_expert = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * _TILE_ROWS, side="right"),
                              num_experts - 1)

    def tile_swiglu(args):
        tile, e = args
        return (jax.nn.silu(tile @ gate[e]) * (tile @ up[e])) @ down[e]

    out = jax.lax.map(tile_swiglu, (tiles.reshape(num_tiles, _TILE_ROWS, -1), tile_expert))
    return out.reshape(num_tiles * _TILE_ROWS, -1)[padded_row]


class SparseMoE(nnx.Module):
    """Router + E stacked SwiGLU experts (+ Qwen3.5's shared expert scaled by sigmoid(shared_expert_gate(x))).

    Parameters mirror the Hub's names: `gate` (the router, kernel [H, E]), `experts.{gate,up,down}_proj`
    stacked [E, in, out], and where `shared_intermediate_size` is given `shared_expert` (an MLP) and
    `shared_expert_gate` (kernel [H, 1])."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, normalize: bool,
                 *, shared_intermediate_size: int | None = None, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.top_k, self.normalize = top_k, normalize
        self.gate = Linear(hidden_size, num_experts, axes=("embed", None), rngs=rngs, param_dtype=param_dtype)
        self.experts = Experts(hidden_size, intermediate_size, num_experts, rngs=rngs, param_dtype=param_dtype)
        if shared_intermediate_size is not None:
            self.shared_expert = MLP(hidden_size, shared_intermediate_size, rngs=rngs, param_dtype=param_dtype)
            self.shared_expert_gate = Linear(hidden_size, 1, axes=("embed", None), rngs=rngs,
                                             param_dtype=param_dtype)
        self.has_shared_expert = shared_intermediate_size is not None

    def __call__(self, x: jax.Array) -> jax.Array:
        rows = x.reshape(-1, x.shape[-1])
        weights, experts = route(self.gate(rows), self.top_k, self.normalize)
        out = self.experts(rows, experts, weights).reshape(x.shape)
        if self.has_shared_expert:  # on x as given: the MLP pins its [batch, length, mlp] activations' layout
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Experts(nnx.Module):
    """E SwiGLU experts stacked on the `expert` axis: gate/up [E, H, I], down [E, I, H] (JAX [in, out])."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        def init(shape):
            return jax.random.normal(rngs.params(), shape, param_dtype) * INIT_STD

        self.gate_proj = param(init((num_experts, hidden_size, intermediate_size)), ("expert", "embed", "mlp"))
        self.up_proj = param(init((num_experts, hidden_size, intermediate_size)), ("expert", "embed", "mlp"))
        self.down_proj = param(init((num_experts, intermediate_size, hidden_size)), ("expert", "mlp", "embed"))

    def __call__(self, rows: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        return grouped_swiglu(rows, experts, weights, self.gate_proj[...], self.up_proj[...], self.down_proj[...])
