"""Routed mixture-of-experts feed-forward block of the Qwen MoE targets (design §8.5), in Flax NNX.

Exactly what transformers computes (`Qwen3MoeSparseMoeBlock`, `Qwen3_5MoeSparseMoeBlock`): a linear router,
softmax over all experts in fp32, the top k per token (ties to the lower expert index; see `route`), the k
weights renormalised to sum 1 when `normalize`; every token reaches its k experts (no capacity limit, nothing
dropped). Dispatch sorts the N*k (token, expert) assignments by expert and runs each SwiGLU projection as one
grouped matmul (`jax.lax.ragged_dot`; on CPU, expert-pure row tiles) over the sorted rows, so the work is
linear in tokens*k, never experts x tokens. Experts are stacked [E, ...] on a leading `expert` logical axis;
where the rule table splits it over the mesh, each device runs its own experts' share
(`expert_parallel_swiglu`, design §13).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from dflash_jax.models.layers import INIT_STD, MLP, Linear, param
from dflash_jax.ops.backends import compile_platform
from dflash_jax.sharding import ROWS, ROWS_EMBED, logical_spec, spec_axes


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


def route_rows(router_logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """`route` of router_logits [b, T, E] laid out as rows (design §13): under a mesh, each device routes its own
    rows (XLA's partitioner would gather the whole batch's probabilities for top_k)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return route(router_logits, top_k, normalize)
    spec = logical_spec(router_logits.shape, (*ROWS, None), dict(mesh.shape))
    return jax.shard_map(lambda logits: route(logits, top_k, normalize), mesh=mesh, in_specs=spec,
                         out_specs=(spec, spec))(router_logits)


# Logical axes of the stacked experts' kernels: gate/up [E, H, I], down [E, I, H].
EXPERT_IN, EXPERT_OUT = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
_TILE_ROWS = 64  # rows per expert tile of the CPU dispatch (`_tiled_swiglu`)


def grouped_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array, *, tiled: bool | None = None) -> jax.Array:
    """sum over k of weights[n, k] * expert_{experts[n, k]}(x[n]), for x [N, H]; gate/up [E, H, I], down [E, I, H].

    The N*k assignments are sorted by expert (stable), so each expert's rows are contiguous; then either one
    `ragged_dot` per projection multiplies every row by its own expert's weights (on TPU), or (tiled, the
    default elsewhere: XLA's CPU and GPU compilers lower ragged_dot to E dense products over all rows, measured
    20x one dense product at E = 16 and 90x at E = 64 on CPU, 6x the model's FLOPs in a planned 35B-A3B GPU
    step; design §8.5) `_tiled_swiglu` does the same products in expert-pure row tiles. The
    products return to their tokens by a scatter-add. Both are exact (the same per-row products).

    An assignment to an expert id outside [0, E) (an expert held by another device, `expert_parallel_swiglu`)
    is sorted after all others and adds nothing; the grouped products stop at the last real row."""
    num_tokens, top_k = experts.shape
    num_experts = gate.shape[0]
    flat_experts = experts.reshape(-1)
    flat_experts = jnp.where((flat_experts >= 0) & (flat_experts < num_experts), flat_experts, num_experts)
    order = jnp.argsort(flat_experts, stable=True)
    token_of_row = order // top_k  # assignment n*k + j belongs to token n
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # others' experts not counted
    rows = x[token_of_row].astype(gate.dtype)
    if tiled if tiled is not None else compile_platform() != "tpu":
        out = _tiled_swiglu(rows, group_sizes, gate, up, down)
    else:
        hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes)) * jax.lax.ragged_dot(rows, up, group_sizes)
        out = jax.lax.ragged_dot(hidden, down, group_sizes)
    computed = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    out = jnp.where(computed[:, None], out * weights.reshape(-1)[order][:, None].astype(out.dtype), 0)
    return jnp.zeros((num_tokens, x.shape[-1]), out.dtype).at[token_of_row].add(out).astype(x.dtype)


def _tiled_swiglu(rows: jax.Array, group_sizes: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:
    """SwiGLU of expert-sorted rows [R, H]: expert e's group_sizes[e] rows contiguous, in expert order, from row
    0; rows after the last group are not computed (their output rows are left zero).

    Each expert's rows are padded to a whole number of _TILE_ROWS-row tiles, so every tile belongs to one
    expert; a loop over the tiles that hold rows (at most R/_TILE_ROWS + E of them, the count known only at run
    time) multiplies each by its expert's weights. Work is (rows in groups + E * _TILE_ROWS) rows, linear in
    tokens, and one expert's weights are live at a time."""
    num_rows, num_experts = rows.shape[0], gate.shape[0]
    num_tiles = -(-num_rows // _TILE_ROWS) + num_experts
    padded_sizes = -(-group_sizes // _TILE_ROWS) * _TILE_ROWS
    padded_ends = jnp.cumsum(padded_sizes)
    group_starts, padded_starts = jnp.cumsum(group_sizes) - group_sizes, padded_ends - padded_sizes
    expert_of_row = jnp.repeat(jnp.arange(num_experts), group_sizes, total_repeat_length=num_rows)
    in_group = jnp.arange(num_rows) < jnp.sum(group_sizes)
    # Rows after the last group go to an index past the tiles: dropped on the way in, zero on the way out.
    padded_row = jnp.where(in_group, padded_starts[expert_of_row] + jnp.arange(num_rows) - group_starts[expert_of_row],
                           num_tiles * _TILE_ROWS)
    tiles = jnp.zeros((num_tiles * _TILE_ROWS, rows.shape[1]), rows.dtype).at[padded_row].set(rows, mode="drop")
    tile_expert = jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * _TILE_ROWS, side="right")

    def tile_swiglu(tile_index, out):
        start = tile_index * _TILE_ROWS
        tile, e = jax.lax.dynamic_slice_in_dim(tiles, start, _TILE_ROWS), tile_expert[tile_index]
        return jax.lax.dynamic_update_slice_in_dim(out, (jax.nn.silu(tile @ gate[e]) * (tile @ up[e])) @ down[e],
                                                   start, axis=0)

    out = jax.lax.fori_loop(0, padded_ends[-1] // _TILE_ROWS, tile_swiglu,
                            jnp.zeros((num_tiles * _TILE_ROWS, down.shape[-1]), rows.dtype))
    return out.at[padded_row].get(mode="fill", fill_value=0)


def expert_parallel_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                           down: jax.Array, mesh, expert_axes: tuple[str, ...], *,
                           tiled: bool | None = None) -> jax.Array:
    """`grouped_swiglu` with the experts split over the mesh axes `expert_axes` (design §13): x [b, T, H] and the
    routing [b, T, k] laid out as rows (ROWS_EMBED), gate/up/down split on their expert axis, each expert whole
    (the partitioner gathers an FSDP-split hidden axis as it enters). Each device computes, for the rows it
    holds, only the assignments to its own E/n experts; the partial sums of a row's k experts are added over
    `expert_axes`. Rows are replicated over an expert axis that does not split them (the tensor axis: the
    dispatch then costs one all-reduce of the output, as a tensor-parallel MLP's); rows split over an expert
    axis are first gathered over it and their sums scattered back. Exact: every assignment is computed once,
    by the device holding its expert, with no capacity limit. With no expert axes (the experts whole on every
    device) each device dispatches its own rows to all experts: left to the partitioner, the sort of the whole
    batch's assignments would gather every device's rows. `tiled` as in `grouped_swiglu`."""
    row_spec = logical_spec(x.shape, ROWS_EMBED, dict(mesh.shape))
    row_axes = spec_axes(row_spec[0])
    gathered = tuple(axis for axis in expert_axes if axis in row_axes)
    summed = tuple(axis for axis in expert_axes if axis not in gathered)
    hidden_size, top_k = x.shape[-1], experts.shape[-1]

    def local(x, experts, weights, gate, up, down):
        if gathered:
            x, experts, weights = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x, experts, weights))
        first = jax.lax.axis_index(expert_axes) * gate.shape[0] if expert_axes else 0  # this device's first expert
        out = grouped_swiglu(x.reshape(-1, hidden_size), (experts - first).reshape(-1, top_k),
                             weights.reshape(-1, top_k), gate, up, down, tiled=tiled).reshape(x.shape)
        if summed:
            out = jax.lax.psum(out, summed)
        if gathered:
            out = jax.lax.psum_scatter(out, gathered, scatter_dimension=0, tiled=True)
        return out

    expert_spec = PartitionSpec(expert_axes or None)
    # check_vma off: the CPU dispatch's loop carries a buffer created inside, which the varying-axes check
    # would otherwise require to be cast to every mesh axis.
    return jax.shard_map(local, mesh=mesh, in_specs=(row_spec, row_spec, row_spec, expert_spec, expert_spec,
                                                     expert_spec), out_specs=row_spec, check_vma=False)(
        x, experts, weights, gate, up, down)


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
        weights, experts = route_rows(self.gate(x), self.top_k, self.normalize)
        out = self.experts(x, experts, weights)
        if self.has_shared_expert:  # on x as given: the MLP pins its [batch, length, mlp] activations' layout
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Experts(nnx.Module):
    """E SwiGLU experts stacked on the `expert` axis: gate/up [E, H, I], down [E, I, H] (JAX [in, out])."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        def init(shape):
            return jax.random.normal(rngs.params(), shape, param_dtype) * INIT_STD

        self.gate_proj = param(init((num_experts, hidden_size, intermediate_size)), EXPERT_IN)
        self.up_proj = param(init((num_experts, hidden_size, intermediate_size)), EXPERT_IN)
        self.down_proj = param(init((num_experts, intermediate_size, hidden_size)), EXPERT_OUT)

    def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        """x [b, T, H]; experts, weights [b, T, k] (`route`)."""
        gate, up, down = self.gate_proj[...], self.up_proj[...], self.down_proj[...]
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:  # each device dispatches its own rows (a global sort would gather the whole batch)
            split = spec_axes(logical_spec(gate.shape, EXPERT_IN, dict(mesh.shape))[0])
            return expert_parallel_swiglu(x, experts, weights, gate, up, down, mesh, split)
        rows = grouped_swiglu(x.reshape(-1, x.shape[-1]), experts.reshape(-1, experts.shape[-1]),
                              weights.reshape(-1, weights.shape[-1]), gate, up, down)
        return rows.reshape(x.shape)
