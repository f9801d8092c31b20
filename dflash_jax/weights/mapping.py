"""Data-driven loading of Hugging Face tensors into an NNX model.

A model family declares a table of `WeightRule`s (HF name pattern -> NNX state path, plus a small per-tensor
fix-up such as a transpose). `load_weights` walks the table, stacks per-layer tensors along the leading
`layers` axis, checks every shape against the model's abstract state, and reports missing and unexpected
tensors by name. Tensors are read one at a time and moved to their device sharding immediately.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

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


def load_weights(abstract_model: nnx.Module, reader: CheckpointReader, rules: Sequence[WeightRule], *,
                 ignore_prefixes: Sequence[str] = (), shardings: nnx.State | None = None) -> nnx.Module:
    """Fill `abstract_model` (from `nnx.eval_shape`) with the checkpoint's tensors and return the real model.

    Each tensor is cast to the dtype of the variable it fills (the model's `param_dtype` choices).

    Raises CheckpointError naming missing tensors, unexpected tensors and shape mismatches.
    """
    graphdef, abstract_state = nnx.split(abstract_model)
    flat_abstract = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}

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

    covered = set()
    for rule in rules:
        if rule.path not in flat_abstract:
            raise KeyError(f"weight table names {'.'.join(rule.path)}, which the model does not have")
        variable = flat_abstract[rule.path]
        expected = tuple(variable.shape)
        pieces = []
        per_tensor = expected[(rule.layers is not None) + (rule.experts is not None):]
        for group in rule.layer_names():
            group_pieces = []
            for name in group:
                try:
                    piece = rule.fixup(reader.read(name))
                except ValueError as error:  # a fix-up that checks its input's shape itself
                    raise CheckpointError(f"{reader.dir}: tensor {name} {error}") from None
                if tuple(piece.shape) != per_tensor:
                    raise CheckpointError(f"{reader.dir}: tensor {name} has shape {tuple(reader.shape(name))}, "
                                          f"expected {_hf_shape(per_tensor, rule.fixup)} for this config")
                group_pieces.append(np.asarray(piece, dtype=np.dtype(variable.dtype)))  # cast on the host
            pieces.append(np.stack(group_pieces) if rule.experts is not None else group_pieces[0])
        value = np.stack(pieces) if rule.layers is not None else pieces[0]
        # Host memory goes straight to each device's shard: staging the whole (stacked) tensor on one device
        # first would need it to fit there, which a large target's stacked MLP kernels do not.
        sharding = flat_shardings[rule.path].get_value() if rule.path in flat_shardings else None
        variable.set_value(jax.device_put(value, sharding))
        covered.add(rule.path)

    uncovered = sorted(".".join(map(str, path)) for path in flat_abstract if path not in covered)
    if uncovered:
        raise KeyError(f"weight table leaves model variables unset: {', '.join(uncovered)}")
    return nnx.merge(graphdef, abstract_state)


def _hf_shape(per_layer_shape: tuple[int, ...], fixup) -> tuple[int, ...]:
    """The shape the HF tensor should have, for error messages (undo the transpose fix-up)."""
    return tuple(reversed(per_layer_shape)) if fixup is transpose else per_layer_shape
