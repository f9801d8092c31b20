"""The collectives of a compiled SPMD program (design §13): their kinds, the device groups XLA prints in any of its
forms, and the bytes one device sends in each (ring algorithms: all-gather (n-1) x its operand; reduce-scatter and
all-to-all (n-1)/n of the operand; all-reduce 2 (n-1)/n, a reduce-scatter then an all-gather; collective-permute
its operand)."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


class Collective(NamedTuple):
    kind: str  # one of COLLECTIVE_KINDS
    axes: tuple[str, ...]  # the mesh axes its device groups span
    remote: bool  # a group spans granules (TPU slices, GPU hosts): the slow link


def _iota(text: str) -> np.ndarray:
    """A device list in XLA's iota form, "[d0,d1,...]" optionally followed by "T(p0,p1,...)"."""
    match = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text.strip())
    if match is None:
        raise ValueError(f"unrecognised device list {text!r}")
    dims = [int(d) for d in match.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match.group(2):
        ids = ids.transpose([int(p) for p in match.group(2).split(",")])
    return ids.reshape(-1)


def replica_groups(attributes: str) -> list[list[int]]:
    """The device groups of a collective: explicit ({{0,1},{2,3}}), iota ([2,2]<=[4]T(1,0)) or mesh form
    (mesh['axis_0'=2,'axis_1'=4], device_ids=([8]) {'axis_1'}); collective-permute's source-target pairs."""
    if (pairs := re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)) is not None:
        return [[int(x) for x in pair.split(",")] for pair in re.findall(r"\{(\d+,\d+)", pairs.group(0))]
    if (explicit := re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attributes)) is not None:
        return [[int(x) for x in group.split(",") if x] for group in re.findall(r"\{([0-9,]*)\}", explicit.group(1))]
    if (iota := re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[0-9,]+\](?:T\([0-9,]+\))?)", attributes)) is not None:
        return _iota(iota.group(3)).reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? \{([^}]*)\}", attributes)
    if mesh is None:
        raise ValueError(f"unrecognised replica groups in {attributes[:300]!r}")
    axes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))}
    devices = math.prod(axes.values())
    ids = _iota(mesh.group(2)) if mesh.group(2) else np.arange(devices)
    # Every axis split into (major, listed sub-axis, minor) parts: "'a':(k)m" is the sub-axis of size m
    # with stride k (Shardy's notation); a whole axis is its own sub-axis.
    dims, grouped = [], []
    listed = dict.fromkeys(axes)
    for item in re.findall(r"'(\w+)'(?::\((\d+)\)(\d+))?", mesh.group(3)):
        listed[item[0]] = (int(item[1]), int(item[2])) if item[1] else (1, axes[item[0]])
    for name, size in axes.items():
        if listed[name] is None:
            dims.append(size)
            continue
        stride, sub = listed[name]
        dims.extend([size // (stride * sub), sub, stride])
        grouped.append(len(dims) - 2)
    grid = ids.reshape(dims)
    kept = [d for d in range(len(dims)) if d not in grouped]
    return grid.transpose(kept + grouped).reshape(-1, math.prod(dims[d] for d in grouped)).tolist()


def collective_bytes(kind: str, operand_bytes: float, group: int) -> float:
    """Bytes one device sends in a collective of `kind` over a group of `group` devices (ring algorithms)."""
    if kind == "all-gather":
        return (group - 1) * operand_bytes
    if kind == "all-reduce":
        return 2.0 * (group - 1) / group * operand_bytes
    if kind == "collective-permute":
        return operand_bytes
    return (group - 1) / group * operand_bytes  # reduce-scatter, all-to-all
