"""Data-driven loading of Hugging Face tensors into an NNX model.

A model family declares a table of `WeightRule`s (HF name pattern -> NNX state path, plus a small per-tensor
fix-up such as a transpose). `load_weights` walks the table one HF layer at a time, checks every shape against
the model's abstract state, reports missing and unexpected tensors by name, and writes each layer into its
variable's stack (the leading `layers` axis) on the device shardings, so host memory holds one layer's tensors
(a layer's experts, for a mixture-of-experts target), not the model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.weights.safetensors_dir import CheckpointReader


def transpose(x: np.ndarray) -> np.ndarray:
    """PyTorch Linear [out, in] -> JAX kernel [in, out]."""
    return x.T


def identity(x: np.ndarray) -> np.ndarray:
    return x


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One HF tensor (or one per layer, stacked) -> one NNX variable.

    hf_name may contain `{layer}`; then `layers` lists the HF layer indices whose tensors are stacked, in
    order, along the leading axis of the NNX variable.
    """

    hf_name: str
    path: tuple[str, ...]
    fixup: Callable[[np.ndarray], np.ndarray] = identity
    layers: Sequence[int] | None = None
    experts: int | None = None  # hf_name has `{expert}`: per layer, experts 0..E-1 stacked on a leading axis

    def layer_names(self) -> list[list[str]]:
        """Per stacked layer (one entry when unstacked), the HF tensors that make it, in stacking order."""
        names = [self.hf_name] if self.layers is None else [self.hf_name.format(layer=i, expert="{expert}")
                                                            for i in self.layers]
        if self.experts is None:
            return [[name] for name in names]
        return [[name.format(expert=e) for e in range(self.experts)] for name in names]

    def names(self) -> list[str]:
        return [name for group in self.layer_names() for name in group]


def layer_groups(rules: Sequence[WeightRule]) -> list[list[tuple[WeightRule, int | None]]]:
    """The rules in reading order, (rule, position in its stack or None): the unstacked ones, then HF layer by
    HF layer every stacked rule holding that layer (a layer's tensors are read together, and only then)."""
    stacked = [rule for rule in rules if rule.layers is not None]
    groups = [[(rule, None) for rule in rules if rule.layers is None]]
    for layer in sorted({i for rule in stacked for i in rule.layers}):
        groups.append([(rule, list(rule.layers).index(layer)) for rule in stacked if layer in rule.layers])
    return groups


def read_group(reader: CheckpointReader, group: list[tuple[WeightRule, int | None]],
               variables: dict) -> list[tuple[WeightRule, int | None, np.ndarray]]:
    """One group of `layer_groups` read from the checkpoint: per rule, its value as the variable holds one layer
    of it (a layer's experts stacked), in the variable's dtype. A tensor two rules take (a fused gate|up
    expert tensor) is read once. CheckpointError names a tensor whose shape does not fit the config."""
    names = [name for rule, position in group for name in rule.layer_names()[position or 0]]
    shared = {name for name in names if names.count(name) > 1}
    cache: dict[str, np.ndarray] = {}
    values = []
    for rule, position in group:
        variable = variables[rule.path]
        per_tensor = tuple(variable.shape[(rule.layers is not None) + (rule.experts is not None):])
        pieces = []
        for name in rule.layer_names()[position or 0]:
            tensor = cache[name] if name in cache else reader.read(name)
            if name in shared:
                cache[name] = tensor
            try:
                piece = rule.fixup(tensor)
            except ValueError as error:  # a fix-up that checks its input's shape itself
                raise CheckpointError(f"{reader.dir}: tensor {name} {error}") from None
            if tuple(piece.shape) != per_tensor:
                raise CheckpointError(f"{reader.dir}: tensor {name} has shape {tuple(reader.shape(name))}, "
                                      f"expected {_hf_shape(per_tensor, rule.fixup)} for this config")
            pieces.append(np.asarray(piece, dtype=np.dtype(variable.dtype)))  # cast on the host
        values.append((rule, position, np.stack(pieces) if rule.experts is not None else pieces[0]))
    return values


class LayerStacks:
    """Device arrays of the model's variables, filled one layer of a stacked variable at a time: only that
    layer travels from the host, straight to each device's shard of it (with a mesh: a device holding a tensor
    split of a layer's experts receives only its experts), so host memory holds a layer, never a whole stack."""

    def __init__(self, variables: dict, shardings: dict):
        self.variables, self.shardings, self.values = variables, shardings, {}

    def put(self, path: tuple, position: int | None, value) -> None:
        """`value` (host or device array) as the variable `path`, or as layer `position` of its stack."""
        sharding = self.shardings.get(path)
        if position is None:
            self.values[path] = jax.device_put(value, sharding)
            return
        if path not in self.values:
            variable = self.variables[path]
            self.values[path] = jax.jit(lambda: jnp.zeros(variable.shape, variable.dtype), out_shardings=sharding)()
        layer_sharding = None if sharding is None else NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
        self.values[path] = _write_layer(self.values[path], jax.device_put(value, layer_sharding),
                                         np.int32(position), sharding)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _write_layer(stack: jax.Array, layer: jax.Array, position, sharding) -> jax.Array:
    stack = jax.lax.dynamic_update_index_in_dim(stack, layer, position, axis=0)  # in place: the stack is donated
    return stack if sharding is None else jax.lax.with_sharding_constraint(stack, sharding)


def load_weights(abstract_model: nnx.Module, reader: CheckpointReader, rules: Sequence[WeightRule], *,
                 ignore_prefixes: Sequence[str] = (), shardings: nnx.State | None = None) -> nnx.Module:
    """Fill `abstract_model` (from `nnx.eval_shape`) with the checkpoint's tensors and return the real model.

    Each tensor is cast to the dtype of the variable it fills (the model's `param_dtype` choices). Tensors are
    read one HF layer at a time and placed on their shardings (`LayerStacks`).

    Raises CheckpointError naming missing tensors, unexpected tensors and shape mismatches.
    """
    graphdef, abstract_state = nnx.split(abstract_model)
    flat_abstract = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = ({path: s.get_value() for path, s in nnx.to_flat_state(shardings)}
                      if shardings is not None else {})

    wanted = {name for rule in rules for name in rule.names()}
    missing = sorted(name for name in wanted if name not in reader)
    unexpected = sorted(name for name in reader.names()
                        if name not in wanted and not name.startswith(tuple(ignore_prefixes)))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
        raise CheckpointError(f"{reader.dir}: " + "; ".join(parts))
    unknown = [".".join(rule.path) for rule in rules if rule.path not in flat_abstract]
    if unknown:
        raise KeyError(f"weight table names {', '.join(unknown)}, which the model does not have")
    uncovered = sorted(".".join(map(str, path)) for path in set(flat_abstract) - {rule.path for rule in rules})
    if uncovered:
        raise KeyError(f"weight table leaves model variables unset: {', '.join(uncovered)}")

    stacks = LayerStacks(flat_abstract, flat_shardings)
    for group in layer_groups(rules):
        for rule, position, value in read_group(reader, group, flat_abstract):
            stacks.put(rule.path, position, value)
    for path, value in stacks.values.items():
        flat_abstract[path].set_value(value)
    return nnx.merge(graphdef, abstract_state)


def _hf_shape(per_layer_shape: tuple[int, ...], fixup) -> tuple[int, ...]:
    """The shape the HF tensor should have, for error messages (undo the transpose fix-up)."""
    return tuple(reversed(per_layer_shape)) if fixup is transpose else per_layer_shape
