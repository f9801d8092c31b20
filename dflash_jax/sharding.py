"""Device mesh and the one table that maps logical weight axes onto mesh axes.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters/optimizer state sharded over
it), `tensor` (tensor parallel: heads and MLP columns). Batches are split over (data, fsdp).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (None = replicated). The only place that decides how weights are laid out.
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("fc_in", "tensor"),
    ("conv", None),
    ("linear_heads", "tensor"),
    ("linear_qkv", "tensor"),
    ("linear_value", "tensor"),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one size may be -1 to take the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices cannot be split into data={data} fsdp={fsdp} tensor={tensor}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} needs "
                         f"{int(np.prod(sizes))} devices, found {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedShardings for every variable of an NNX state, from its logical axis names and LOGICAL_RULES."""
    with nnx.logical_axis_rules(LOGICAL_RULES):
        return nnx.get_named_sharding(state, mesh)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows split over (data, fsdp); every other dimension replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
