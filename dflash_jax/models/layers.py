"""Building blocks shared by the targets and the drafter.

Every parameter carries logical axis names (`embed`, `vocab`, `q_heads`, `kv_heads`, `mlp`, `head_dim`, ...);
`dflash_jax.sharding.LOGICAL_RULES` maps them onto the (data, fsdp, context, tensor) mesh in one table.
Linear kernels are stored [in, out] (JAX layout); Hugging Face stores [out, in].
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from dflash_jax.ops.backends import compile_platform
from dflash_jax.sharding import BATCH_AXES, ROWS_EMBED, ROWS_MLP, constrain, logical_spec

INIT_STD = 0.02  # HF Qwen `initializer_range`


def param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    """A trainable weight carrying the logical names of its axes. It is created unsharded: shardings come from
    the logical-axis rules (`dflash_jax.sharding`), applied by jit in/out shardings under the mesh."""
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ kernel, no bias. `axes` names the (in, out) kernel dimensions.

    dtype is the compute dtype (e.g. bf16 over fp32 master weights); None computes in the kernel's dtype.
    """

    def __init__(self, in_features: int, out_features: int, *, axes: tuple[str, str], rngs: nnx.Rngs,
                 param_dtype=jnp.float32, dtype=None):
        init = jax.random.normal(rngs.params(), (in_features, out_features), param_dtype) * INIT_STD
        self.kernel = param(init, axes)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        dtype = kernel.dtype if self.dtype is None else self.dtype
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        return _dot_transposing_narrow_side(x, kernel) if compile_platform() == "cpu" else jnp.dot(x, kernel)


@jax.custom_vjp
def _dot_transposing_narrow_side(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel, whose kernel gradient xᵀ·dy is computed from an explicit transpose of the narrower of x
    [..., in] and dy [..., out]. Left to itself, XLA:CPU folds a transpose into that dot and then copies an
    operand into the layout its matmul wants, often the wider one, with dy's own producer (e.g. the SwiGLU
    backward) recomputed inside the transposing copy; on the toy drafter's MLP that copy cost as much as a
    third of the forward + backward (bench/RESULTS.md). Same products, so the same values to fp32 rounding."""
    return jnp.dot(x, kernel)


def _dot_forward(x, kernel):
    return jnp.dot(x, kernel), (x, kernel)


def _dot_backward(residuals, dy):
    x, kernel = residuals
    dx = jax.lax.dot_general(dy, kernel, (((dy.ndim - 1,), (1,)), ((), ())))  # dy @ kernelᵀ
    rows_x, rows_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    # The barrier keeps the transpose a copy of its own instead of folding it back into the dot.
    if kernel.shape[0] <= kernel.shape[1]:  # in <= out: transpose x, [in, rows] @ [rows, out]
        dkernel = jnp.dot(jax.lax.optimization_barrier(rows_x.T), rows_dy)
    else:  # transpose dy, ([out, rows] @ [rows, in])ᵀ
        dkernel = jnp.dot(jax.lax.optimization_barrier(rows_dy.T), rows_x).T
    return dx, dkernel


_dot_transposing_narrow_side.defvjp(_dot_forward, _dot_backward)


class Embed(nnx.Module):
    """Token embedding table [vocab, embed]; `attend` is the tied LM head."""

    def __init__(self, vocab_size: int, features: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        init = jax.random.normal(rngs.params(), (vocab_size, features), param_dtype) * INIT_STD
        self.embedding = param(init, ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [b, L] -> [b, L, features]; under a mesh, rows split over the batch axes (`_lookup_by_rows` when
        the table's hidden axis is split over fsdp, as the rules in force say)."""
        table = self.embedding[...]
        mesh = jax.sharding.get_abstract_mesh()
        batch_shards = 1 if mesh.empty else mesh.shape["data"] * mesh.shape["fsdp"]
        if (ids.ndim != 2 or batch_shards == 1 or ids.shape[0] % batch_shards
                or logical_spec(table.shape, ("vocab", "embed"), dict(mesh.shape))[1] != "fsdp"):
            return jnp.take(table, ids, axis=0)
        lookup = jax.shard_map(_lookup_by_rows, in_specs=(PartitionSpec(None, "fsdp"), PartitionSpec(BATCH_AXES)),
                               out_specs=PartitionSpec(BATCH_AXES))
        return constrain(lookup(table, ids), ROWS_EMBED)

    def attend(self, x: jax.Array) -> jax.Array:
        table = self.embedding[...]
        return jnp.dot(x.astype(table.dtype), table.T)


def _lookup_by_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Per device: `table` is the device's hidden slice [V, H/fsdp] (gathered over the vocabulary shards only),
    `ids` its own rows. It looks up the ids of every row of its fsdp group (integers: cheap to gather), then
    one all-to-all trades hidden slices for rows, so no float activation of more than the device's own rows
    is ever gathered (the partitioner's own choice for a hidden-sharded table is not always that)."""
    group_ids = jax.lax.all_gather(ids, "fsdp", axis=0, tiled=True)
    return jax.lax.all_to_all(jnp.take(table, group_ids, axis=0), "fsdp", split_axis=0, concat_axis=2, tiled=True)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis.

    zero_centered=False is Qwen3's `w * x̂` with x̂ cast to the input dtype before the multiply
    (transformers `Qwen3RMSNorm`); zero_centered=True is Qwen3.5's `(1 + w) * x̂` computed in fp32 and cast
    once (transformers `Qwen3_5RMSNorm`). Weights start at 1 (plain) or 0 (zero-centred): both mean identity.
    """

    def __init__(self, features: int, *, eps: float, zero_centered: bool = False, axis_name: str = "embed",
                 param_dtype=jnp.float32):
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = param(init((features,), param_dtype), (axis_name,))
        self.eps = eps
        self.zero_centered = zero_centered

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        weight = self.weight[...]
        if self.zero_centered:
            return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        return weight.astype(x.dtype) * normed.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 dtype=None):
        self.gate_proj = Linear(hidden_size, intermediate_size, axes=("embed", "mlp"), rngs=rngs,
                                param_dtype=param_dtype, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, axes=("embed", "mlp"), rngs=rngs,
                              param_dtype=param_dtype, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, axes=("mlp", "embed"), rngs=rngs,
                                param_dtype=param_dtype, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), ROWS_MLP))


def decoder_layer_params(hidden: int, q_heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Matmul weights of one Qwen3 decoder layer (q/k/v/o projections and the SwiGLU MLP), for FLOP counts."""
    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    return hidden * (2 * q_width + 2 * kv_width) + 3 * hidden * intermediate


class Rope(NamedTuple):
    """RoPE tables: inverse frequencies and the factor cos/sin are multiplied by (YaRN's attention scaling)."""
    inv_freq: np.ndarray  # [rotary_dim / 2] fp32
    attention_scaling: float = 1.0


SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


def rope_type_of(scaling: dict | None) -> str:
    """The rope type of a `rope_scaling` / `rope_parameters` dict (key `rope_type`, or `type` in older files)."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_frequencies(rotary_dim: int, theta: float, scaling: dict | None = None,
                     max_position_embeddings: int | None = None) -> Rope:
    """RoPE tables as transformers' `modeling_rope_utils` computes them (design §8.6).

    default: inv_freq[i] = theta^(-2i/rotary_dim). linear: inv_freq / factor. yarn (arXiv 2309.00071, transformers
    `_compute_yarn_parameters`): per frequency a ramp between the interpolated (inv_freq / factor) and the original
    frequency, by the dimension's rotations over `original_max_position_embeddings` (beta_fast / beta_slow), and
    cos/sin scaled by `attention_factor` (default 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio).
    Any other type is refused rather than silently mistrained.
    """
    scaling = dict(scaling or {})
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / theta**exponents
    if rope_type == "default":
        return Rope(inv_freq.astype(np.float32))
    if rope_type == "linear":
        return Rope((inv_freq / float(_rope_field(scaling, "factor"))).astype(np.float32))
    return _yarn(inv_freq, rotary_dim, theta, scaling, max_position_embeddings)


def _rope_field(scaling: dict, name: str):
    if scaling.get(name) is None:
        raise ValueError(f"rope_scaling type {rope_type_of(scaling)!r} needs {name!r}; got {scaling!r}")
    return scaling[name]


def _yarn(inv_freq: np.ndarray, rotary_dim: int, theta: float, scaling: dict,
          max_position_embeddings: int | None) -> Rope:
    # transformers fills a missing original_max_position_embeddings from config.max_position_embeddings
    # (`standardize_rope_params`), and a missing factor from max_position_embeddings / original.
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if original is None:
        raise ValueError(f"rope_scaling type 'yarn' needs 'original_max_position_embeddings'; got {scaling!r}")
    factor = scaling.get("factor")
    if factor is None and max_position_embeddings is None:
        raise ValueError(f"rope_scaling type 'yarn' needs 'factor'; got {scaling!r}")
    factor = float(factor if factor is not None else max_position_embeddings / original)

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a zero-width ramp
    # fp32 like transformers' ramp and frequencies, so the tables agree bit for bit at long positions.
    inv_freq = inv_freq.astype(np.float32)
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    blended = (inv_freq / np.float32(factor)) * (1 - extrapolation) + inv_freq * extrapolation
    return Rope(blended.astype(np.float32), float(attention_factor))


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope) -> jax.Array:
    """Rotate-half RoPE on the first 2*len(rope.inv_freq) features of the last axis (the rest pass through).

    x: [..., T, heads, head_dim]; positions: [..., T]. cos/sin are computed in fp32, scaled by
    rope.attention_scaling and cast to x.dtype, as transformers does.
    """
    rotary_dim = 2 * rope.inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inv_freq)  # [..., T, rotary_dim/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # broadcast over heads
    cos, sin = jnp.cos(angles) * rope.attention_scaling, jnp.sin(angles) * rope.attention_scaling
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)
