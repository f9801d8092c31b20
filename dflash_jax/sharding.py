"""Device mesh and the one table that maps logical axes, of weights and of activations, onto mesh axes.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters/optimizer state sharded over
it), `context` (one row's tokens split into contiguous shards, design §19), `tensor` (tensor parallel: heads and
MLP columns). Batches are split over (data, fsdp), their tokens over context.

Weights carry logical names on their variables (models/layers.py). Activations carry them through
`constrain(x, axes)` at the points that decide the layout (after the embedding, around attention and MLP,
layer outputs, the loss and label inputs): rows stay split over (data, fsdp) and the hidden axis whole, so
the partitioner all-gathers the FSDP-sharded weights (bf16, one layer at a time) instead of resharding
activations of the whole global batch (design §13).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "context", "tensor")
CONTEXT_AXIS = "context"
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis or axes (None = replicated). The only place that decides how weights and
# activations are laid out.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("fc_in", "tensor"),
    ("conv", None),
    # DSpark heads (models/dspark_heads.py, design §18): the Markov rank and the confidence input [H + r] are
    # small, kept whole.
    ("markov_rank", None),
    ("confidence_in", None),
    # DFlash2's convolutions and selector (models/dflash2.py, design §18.4): the two sides, the taps, the
    # projection to their dynamic kernels and the selector's rank are small, kept whole.
    ("conv_side", None),
    ("conv_taps", None),
    ("conv_kernels", None),
    ("selector_rank", None),
    ("linear_heads", "tensor"),
    ("linear_key", "tensor"),
    ("linear_value", "tensor"),
    # Stacked MoE experts [E, H, I] (models/moe.py): split over tensor, whose devices hold the same rows, so each
    # runs its own experts' share of them and one all-reduce adds the shares (design §13). Each expert's hidden
    # axis follows embed (fsdp in the fsdp layout); its mlp axis stays whole (tensor is taken by the experts).
    ("expert", "tensor"),
    # Activations (MaxText's activation_* names).
    ("activation_batch", BATCH_AXES),
    ("activation_length", CONTEXT_AXIS),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_head_dim", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
)
# The activation layouts the models use, by what the array holds.
ROWS_EMBED = ("activation_batch", "activation_length", "activation_embed")  # [b, T, H]
ROWS_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")  # [b, T, h, D]
ROWS_KV_HEADS = ("activation_batch", "activation_length", "activation_kv_heads", "activation_head_dim")
ROWS_MLP = ("activation_batch", "activation_length", "activation_mlp")  # [b, T, I]
ROWS_VOCAB = ("activation_batch", "activation_length", "activation_vocab")  # [b, T, V chunk]
ROWS = ("activation_batch", "activation_length")  # [b, T] (labels, per-token losses)
# A row's drafted slots by context shard, [b, C, R/C, ...] (train/step.py): the loss's chunks stay on a shard.
SHARD_ROWS_EMBED = ("activation_batch", "activation_length", None, "activation_embed")
SHARD_ROWS_VOCAB = ("activation_batch", "activation_length", None, "activation_vocab")
# The frozen LM head [H, V] as the labels and the loss read it: gathered whole over fsdp once per step, the
# vocabulary split over tensor, so that neither loop over its chunks gathers it again (design §13).
LM_HEAD = ("activation_embed", "activation_vocab")

# The frozen target's weight layouts (config.target_layout), as overrides of the weight rules above; the
# activation rules stay as they are. "fsdp": the table itself (hidden axis over fsdp, heads / MLP / vocabulary
# over tensor; a layer's weights are all-gathered as it runs). "tensor": heads / MLP / vocabulary over tensor
# only, every (data, fsdp) group holding a whole copy (no weight traffic; the target must fit in 1/tensor of a
# device). "replicate": every device holds the whole target.
TARGET_LAYOUTS: dict[str, dict[str, None]] = {
    "fsdp": {},
    "tensor": {"embed": None},
    "replicate": {name: None for name, _ in LOGICAL_RULES if not name.startswith("activation_")},
}


# config.target_layout = "auto": the layout with the least weight traffic ("replicate" none at all, "tensor"
# none across (data, fsdp), "fsdp" a whole copy gathered every step) whose target fits in this share of a
# device's memory, the rest left to activations, the drafter and its optimizer state; `plan --compare` ranks
# the layouts by the compiled step's predicted time instead (design §13).
AUTO_LAYOUT_SHARE = 0.5
AUTO_LAYOUT_ORDER = ("replicate", "tensor", "fsdp")


def auto_target_layout(bytes_by_layout: dict[str, int], budget_bytes: float | None) -> str:
    """The layout "auto" stands for, given the target's bytes per device in each layout: without a memory
    budget (simulated CPU devices), "fsdp", the layout that fits wherever any does."""
    if budget_bytes is None:
        return "fsdp"
    return next((layout for layout in AUTO_LAYOUT_ORDER
                 if bytes_by_layout[layout] <= AUTO_LAYOUT_SHARE * budget_bytes), "fsdp")


def layout_rules(target_layout: str) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """LOGICAL_RULES with the weight rules of a target layout (TARGET_LAYOUTS) in place."""
    overrides = TARGET_LAYOUTS[target_layout]
    return tuple((name, overrides.get(name, mapped)) for name, mapped in LOGICAL_RULES)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None, dcn_data: int = 1,
              context: int = 1) -> Mesh:
    """A (data, fsdp, context, tensor) mesh; one size may be -1 to take the remaining devices.

    Devices are placed by `mesh_utils.create_device_mesh`, which follows the physical topology (TPU tori,
    GPU ids) so that the last axes, the most communication-heavy (tensor, then context, then fsdp), connect
    neighbours.
    With dcn_data > 1 the data axis also spans that many slices (TPU multi-slice, or GPU hosts: one
    granule per process) joined by the data-centre network, which then carries only the data axis's
    gradient all-reduce (`create_hybrid_device_mesh`); the sizes given are those within one slice, so the
    mesh's data axis is data x dcn_data. Simulated devices of one process without slices (a GPU cluster
    planned on CPU devices, dflash_jax/planning/plan.py) are taken as consecutive blocks, one per slice.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, context, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} context={context} "
                         f"tensor={tensor}")
    if dcn_data < 1 or len(devices) % dcn_data:
        raise ValueError(f"{len(devices)} devices cannot be split into dcn_data={dcn_data} slices")
    per_slice = len(devices) // dcn_data
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if per_slice % known:
            raise ValueError(f"{per_slice} devices per slice cannot be split into data={data} fsdp={fsdp} "
                             f"context={context} tensor={tensor}")
        sizes[sizes.index(-1)] = per_slice // known
    if int(np.prod(sizes)) != per_slice:
        raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x context={sizes[2]} x tensor={sizes[3]} needs "
                         f"{int(np.prod(sizes))} devices per slice, found {per_slice}")
    # TPU granules are slices; GPU devices may carry a slice index too (all 0), but their granules are hosts.
    by_slice = devices[0].platform == "tpu"
    simulated = not by_slice and len({d.process_index for d in devices}) == 1
    if dcn_data == 1:
        placed = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    elif simulated:
        placed = np.array(devices).reshape(dcn_data * sizes[0], *sizes[1:])
    else:
        placed = mesh_utils.create_hybrid_device_mesh(
            sizes, (dcn_data, 1, 1, 1), devices, process_is_granule=not by_slice,
            allow_split_physical_axes=True)
    return Mesh(placed, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def state_shardings(state: nnx.State, mesh: Mesh, target_layout: str = "fsdp") -> nnx.State:
    """NamedShardings for every variable of an NNX state, from its logical axis names and the rule table (the
    target's weights: with the rules of its layout, `layout_rules`), dimension by dimension as `logical_spec`
    places them (a mesh axis used once, only where it divides)."""
    def sharding(variable):
        axes = variable.get_metadata().get("out_sharding")
        spec = logical_spec(variable.shape, tuple(axes), dict(mesh.shape)) if axes else PartitionSpec()
        return variable.replace(NamedSharding(mesh, spec))

    with nnx.logical_axis_rules(layout_rules(target_layout)):
        return jax.tree.map(lambda leaf: sharding(leaf) if isinstance(leaf, nnx.Variable)
                            else NamedSharding(mesh, PartitionSpec()), state,
                            is_leaf=lambda leaf: isinstance(leaf, nnx.Variable))


def active_rules() -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """The rules in force: those of an enclosing `nnx.logical_axis_rules(layout_rules(...))` (the train step
    traces the target's forward under its layout's), else LOGICAL_RULES."""
    return tuple(spmd.get_logical_axis_rules()) or LOGICAL_RULES


def row_split_axes(mesh, rows: int) -> tuple[str, ...]:
    """The batch axes of `mesh` (concrete or abstract) that `rows` rows split over inside a shard_map: all of them
    where they divide the rows evenly, else none (e.g. evaluation's single row: every shard takes them all)."""
    axes = tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)
    return axes if rows % math.prod(mesh.shape[axis] for axis in axes) == 0 else ()


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows split over (data, fsdp); every other dimension replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def token_sharding(mesh: Mesh) -> NamedSharding:
    """Training rows [B, T]: rows split over (data, fsdp), their tokens over context (design §19)."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, CONTEXT_AXIS))


def context_shards() -> int:
    """How many shards the current mesh (`constrain`'s) splits a row's tokens into; 1 without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def spec_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec (or a rule of the table) names: none, one, or several."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def logical_spec(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh_shape: dict[str, int]) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dimensions carry the logical `axes` (`active_rules`).

    A dimension keeps only the mesh axes the mesh has and that divide it together (e.g. 4 kv heads stay
    whole on tensor = 8, evaluation's single row on data x fsdp = 8), and a mesh axis is used once.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match the array shape {shape}")
    rules, used, spec = dict(active_rules()), set(), []
    for size, name in zip(shape, axes):
        mapped = rules[name] if name is not None else None
        mapped = spec_axes(mapped)
        kept = tuple(axis for axis in mapped if axis in mesh_shape and axis not in used)
        if kept and size % int(np.prod([mesh_shape[axis] for axis in kept])) == 0:
            used.update(kept)
            spec.append(kept if len(kept) > 1 else kept[0])
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Pins activation `x` to the layout its logical `axes` give under the current mesh (`jax.set_mesh` or
    `jax.sharding.use_abstract_mesh`, which the train step enters); unchanged without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(x.shape, axes, dict(mesh.shape)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
