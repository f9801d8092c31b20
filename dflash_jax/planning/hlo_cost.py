"""What one device does in a compiled program, read from its optimized HLO text (design §13): matmul FLOPs,
HBM bytes and the bytes each collective moves, with every loop body counted as many times as it runs.

XLA's own `cost_analysis()` counts a while loop's body once (a scanned layer stack of 64 layers as one layer)
and does not split communication by kind or by the mesh axes it crosses; both decide the step time of a pod.

- Loops: a computation runs (sum over its callers) caller's count x the while loop's trip count: XLA's
  `known_trip_count` annotation, else the `index < N` of its condition (TPU programs carry no annotation); a
  loop with neither counts once and is reported in `unknown_loops`.
- FLOPs: 2 x output elements x contracted size for each `dot` (on GPU inside Triton gemm fusions, or a cuBLAS
  gemm custom call where the compiler chose one); for a `convolution` (TPU lowers many dots to
  one), 2 x output elements x the kernel's input features x the window positions that meet a real input
  element (padding and dilation holes excluded, as HloCostAnalysis counts them). Elementwise
  work and other custom calls (Pallas kernels such as splash attention, cuDNN attention) are not counted;
  `custom_calls` says how many ran.
- HBM bytes: operands plus outputs of every instruction outside fusion bodies (what a fusion reads and writes
  reaches memory; its insides do not), dynamic slices and in-place updates (also among a fusion's results)
  counting only the slice, the same approximation as XLA's "bytes accessed"; arrays in a memory space other than
  HBM (TPU layouts' S(1) and up: memory-space assignment's on-chip copies) count nothing, an asynchronous slice
  (libtpu's prefetch of a weight's piece) only its piece.
- Largest arrays: the biggest single arrays of instructions outside fusion bodies (aliases excluded), with the
  JAX operation each came from: what the compiler's temporaries are made of.
- Collectives: the bytes each device sends (`collectives.py`, ring algorithms); GPU's asynchronous collectives
  are counted at their `-start`. Each is keyed by the mesh axes its groups span and by whether a group leaves a
  granule (a TPU slice, a GPU host): the link it crosses.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from dflash_jax.planning.collectives import COLLECTIVE_KINDS, Collective, collective_bytes, replica_groups

_ITEM_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
# Instructions that move no data of their own (aliases, control flow whose bodies are counted, markers).
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
               "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "async-start", "async-update",
               "async-done", "all-gather-done", "all-reduce-done", "collective-permute-done", "reduce-scatter-done",
               "all-to-all-done", "copy-done", "slice-done",
               "send-done", "recv-done", "add-dependency", "domain"}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2|c64|c128)\[([0-9,]*)\]")
_ARRAY_LAYOUT = re.compile(_ARRAY.pattern + r"(\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) ")
_COMMENT = re.compile(r"/\*.*?\*/")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUBLAS_GEMM = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)"')
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_JIT_PREFIX = re.compile(r"^jit\([^)]*\)/")
# Instructions whose result is another's buffer, not an array of its own.
_ALIASES = {"parameter", "constant", "bitcast", "get-tuple-element"}
LARGEST_COUNT = 6


class LargeArray(NamedTuple):
    """An array the compiled program materialises, `count` times: what the temporaries are made of."""

    bytes: int
    dtype: str  # HLO's names: bf16, f32, s32, ...
    shape: tuple[int, ...]
    op: str  # the HLO instruction (all-gather, fusion, dot, ...)
    origin: str  # the JAX operation it came from
    count: int

    @property
    def text(self) -> str:
        text = f"{self.dtype}[{','.join(map(str, self.shape))}] {self.op} {self.origin}".strip()
        return f"{text} (x{self.count})" if self.count > 1 else text


class HloCost(NamedTuple):
    flops: float  # matmul FLOPs of one device, loop bodies times their trip counts
    hbm_bytes: float
    collective_bytes: dict[Collective, float]  # bytes one device sends, by kind, axes and link
    custom_calls: int  # kernel calls run (their FLOPs are not in `flops`)
    unknown_loops: int  # while loops without a known trip count (counted once)
    largest: tuple[LargeArray, ...] = ()  # the LARGEST_COUNT biggest arrays outside fusion bodies, largest first


class _Instruction(NamedTuple):
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str


def _array_bytes(shape: str, hbm_only: bool = False) -> float:
    """Bytes of an array or tuple shape text (every array inside it). hbm_only: only the arrays in the default
    memory space (TPU layouts mark those that memory-space assignment placed on the chip, S(1) and up)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEM_BYTES[dtype]
               for dtype, dims, layout in _ARRAY_LAYOUT.findall(shape)
               if not (hbm_only and any(space != "0" for space in _MEMORY_SPACE.findall(layout))))


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one opened at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return i
    raise ValueError(f"unbalanced brackets in HLO line: {text[:200]}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]] if text.strip() else parts


def _parse_instruction(line: str) -> _Instruction | None:
    body = _COMMENT.sub("", line).strip().removeprefix("ROOT ")
    if not body.startswith("%") or " = " not in body:
        return None
    name, rest = body[1:].split(" = ", 1)
    shape_end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:shape_end], rest[shape_end:].lstrip()
    open_paren = rest.index("(")
    close_paren = _closing(rest, open_paren)
    operands = [part.split()[-1].lstrip("%") for part in _split_top_level(rest[open_paren + 1:close_paren])
                if part.split()]
    return _Instruction(name, shape, rest[:open_paren], operands, rest[close_paren + 1:])


def _computations(hlo: str) -> tuple[dict[str, list[_Instruction]], str]:
    """Instructions by computation name, and the entry computation's name."""
    computations: dict[str, list[_Instruction]] = {}
    current, entry = None, None
    for line in hlo.splitlines():
        if line and not line[0].isspace():
            header = _HEADER.match(line) if line.rstrip().endswith("{") else None
            if header is not None:
                current = header.group(1)
                computations[current] = []
                entry = current if line.startswith("ENTRY") else entry
            elif line.rstrip() == "}":
                current = None
            continue  # else the rest of a string that held a line break (op_name metadata)
        if current is not None and (instruction := _parse_instruction(line)) is not None:
            computations[current].append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _callees(instruction: _Instruction) -> list[tuple[str, str]]:
    """(role, computation) pairs an instruction calls: role "body"/"condition" (a while loop), "fused" (a
    fusion's body), "scalar" (a reduction's per-element function) or "called"."""
    found = []
    for role, names in re.findall(r"\b(body|condition|calls|to_apply|branch_computations|true_computation|"
                                  r"false_computation)=(\{[^}]*\}|%[^\s,]+)", instruction.attributes):
        for name in re.findall(r"%([^\s,{}]+)", names):
            if role == "calls":
                role = "fused" if instruction.opcode == "fusion" else "called"
            found.append(("scalar" if role == "to_apply" else role, name))
    return found


def _constant(instruction: _Instruction | None) -> int | None:
    match = re.fullmatch(r"(-?\d+)", instruction.operands[0]) if instruction and instruction.opcode == "constant" \
        else None
    return int(match.group(1)) if match else None


def _trip_count(loop: _Instruction, computations: dict[str, list[_Instruction]],
                defined: dict[str, _Instruction]) -> int | None:
    """XLA's known_trip_count; else, for a loop whose condition is `index < N` (TPU prints no annotation),
    N minus the index's start in the loop's initial tuple (0 when that is not a constant), over the index's
    step: a constant the body adds to it (libtpu's windowed einsum loops, unrolled twice, step by 2), else 1."""
    if (known := _TRIP_COUNT.search(loop.attributes)) is not None:
        return int(known.group(1))
    callees = dict(_callees(loop))
    condition = computations.get(callees.get("condition"), [])
    for instruction in condition:
        if instruction.opcode == "compare" and "direction=LT" in instruction.attributes:
            bound = _constant(next((i for i in condition if i.name == instruction.operands[1]), None))
            if bound is None:
                return None
            index = next((i for i in condition if i.name == instruction.operands[0]), None)
            position = re.search(r"\bindex=(\d+)", index.attributes) if index and index.opcode == "get-tuple-element" \
                else None
            initial = defined.get(loop.operands[0])
            start = None
            if initial and initial.opcode == "tuple":
                start = _constant(defined.get(initial.operands[int(position.group(1)) if position else 0]))
            step = _index_step(computations.get(callees.get("body"), []), int(position.group(1))) if position else 1
            return -(-(bound - (start or 0)) // step)
    return None


def _index_step(body: list[_Instruction], position: int) -> int:
    """What a loop body adds to the loop index at tuple `position` each iteration: the constant of the add that
    makes that element of the body's result, else 1."""
    if not body or body[-1].opcode != "tuple" or position >= len(body[-1].operands):
        return 1
    named = {i.name: i for i in body}
    update = named.get(body[-1].operands[position])
    if update is None or update.opcode != "add":
        return 1
    steps = [_constant(named.get(operand)) for operand in update.operands]
    return next((step for step in steps if step and step > 0), 1)


def _multiplicities(computations: dict[str, list[_Instruction]], entry: str) -> tuple[dict[str, float], set[str], int]:
    """How many times each computation runs per call of the entry, the fusion bodies, and the number of
    loops whose trip count is unknown (counted once). Callers are visited before their callees (a depth-first
    order of the call graph, reversed), so each computation's count is complete when it is handed on."""
    defined = {i.name: i for instructions in computations.values() for i in instructions}
    calls: dict[str, list[tuple[str, float]]] = {}
    fused = set()
    for name, instructions in computations.items():
        calls[name] = []
        for instruction in instructions:
            trip = _trip_count(instruction, computations, defined) if instruction.opcode == "while" else 1
            for role, callee in _callees(instruction):
                if role != "scalar" and callee in computations:
                    calls[name].append((callee, float(trip or 1)))
                    fused.update([callee] if role == "fused" else [])
    order, seen = [], set()

    def visit(name: str) -> None:
        seen.add(name)
        for callee, _ in calls[name]:
            if callee not in seen:
                visit(callee)
        order.append(name)

    visit(entry)
    runs: dict[str, float] = defaultdict(float, {entry: 1.0})
    for name in reversed(order):
        for callee, factor in calls[name]:
            runs[callee] += runs[name] * factor
    reached = set(order)
    return runs, fused & reached, sum(1 for name in reached for i in computations[name]
                                      if i.opcode == "while" and _trip_count(i, computations, defined) is None)


def _is_matmul(instruction: _Instruction) -> bool:
    return instruction.opcode in ("dot", "convolution") or (
        instruction.opcode == "custom-call" and _CUBLAS_GEMM.search(instruction.attributes) is not None)


def _dot_flops(instruction: _Instruction, shapes: dict[str, str]) -> float:
    outputs = math.prod(_dims(instruction.shape))  # a cuBLAS gemm's first array: its result, then its workspace
    if instruction.opcode != "convolution":
        lhs = _dims(shapes[instruction.operands[0]])
        if instruction.opcode == "dot":
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instruction.attributes)
        else:
            contracting = _GEMM_CONTRACTING.search(instruction.attributes)
        dims = re.findall(r"\d+", contracting.group(1)) if contracting else []
        return 2.0 * outputs * math.prod(lhs[int(d)] for d in dims)
    return 2.0 * outputs * _convolution_products(instruction, shapes)


def _window(attributes: str, key: str, spatial: int) -> list[int]:
    """A convolution window's `key` (size, stride, lhs_dilate, rhs_dilate) per spatial dimension; 1 if absent."""
    found = re.search(rf"\b{key}=([0-9x]+)", attributes)
    return [int(v) for v in found.group(1).split("x")] if found else [1] * spatial


def _convolution_products(instruction: _Instruction, shapes: dict[str, str]) -> float:
    """Multiply-adds per output element of a convolution: the kernel's input features times the window
    positions that fall on real input elements, averaged over the output positions. TPU lowers a batched dot
    to a convolution whose batch dimensions are spatial, windowed and dilated so that one window position of
    each output meets an input element (`window={size=48x64 stride=47x63 lhs_dilate=48x64}`) or padded so
    (`size=48 pad=47_47`); counting every window position would count such a dot 48 x 64 times over."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.attributes)
    lhs, kernel, out = _dims(shapes[instruction.operands[0]]), _dims(shapes[instruction.operands[1]]), \
        _dims(instruction.shape)
    if labels is None:
        return float(math.prod(kernel) / (kernel[-1] if kernel else 1))
    lhs_labels, kernel_labels, out_labels = labels.groups()
    products = float(kernel[kernel_labels.index("i")])
    spatial = sum(label.isdigit() for label in kernel_labels)
    size, stride, lhs_dilate, rhs_dilate = (_window(instruction.attributes, key, spatial)
                                            for key in ("size", "stride", "lhs_dilate", "rhs_dilate"))
    pads = re.search(r"\bpad=([0-9_x-]+)", instruction.attributes)
    pad_low = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * spatial
    for d in range(spatial):
        inputs, outputs = lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))]
        position = (np.arange(outputs)[:, None] * stride[d] + np.arange(size[d])[None, :] * rhs_dilate[d]
                    - pad_low[d])  # in the dilated, padded input
        real = (position >= 0) & (position <= (inputs - 1) * lhs_dilate[d]) & (position % lhs_dilate[d] == 0)
        products *= real.sum() / outputs
    return products


def _sliced_parameters(body: list[_Instruction], computations: dict[str, list[_Instruction]]) -> dict[int, float]:
    """Parameter number -> bytes read, for a fusion body's parameters that are only sliced inside it (directly,
    or in a fusion nested in it)."""
    numbers = {i.name: int(i.operands[0]) for i in body if i.opcode == "parameter"}
    users: dict[str, list[_Instruction]] = defaultdict(list)
    for instruction in body:
        for operand in instruction.operands:
            users[operand].append(instruction)
    sliced = {}
    for name, number in numbers.items():
        read = 0.0
        for use in users.get(name, []) or [None]:
            if use is not None and use.opcode in ("dynamic-slice", "slice") and use.operands[0] == name:
                read += _array_bytes(use.shape)
                continue
            inner = {} if use is None or use.opcode != "fusion" else _sliced_parameters(
                computations.get(dict(_callees(use)).get("fused"), []), computations)
            position = use.operands.index(name) if use is not None and name in use.operands else None
            if position not in inner:
                break
            read += inner[position]
        else:
            sliced[number] = read
    return sliced


def _traffic(instruction: _Instruction, shapes: dict[str, str], computations: dict[str, list[_Instruction]]) -> float:
    """HBM bytes an instruction outside fusion bodies reads and writes: its operands and output, except that a
    dynamic slice reads only the slice, and a dynamic update (alone or among a fusion's results: the scans'
    stacked outputs) writes its update into the buffer in place, as XLA's cost analysis counts them. Arrays placed
    on the chip (TPU's S(n) layouts: what memory-space assignment prefetched) move no HBM bytes; an asynchronous
    slice (TPU's prefetch of a piece of a weight) reads only its piece."""
    def hbm(shape: str) -> float:
        return _array_bytes(shape, hbm_only=True)

    if instruction.opcode == "slice-start":  # ((source), piece, context)
        piece = _split_top_level(instruction.shape[1:-1])[1]
        return (_array_bytes(piece) if hbm(shapes.get(instruction.operands[0], "")) else 0.0) + hbm(piece)
    if instruction.opcode.endswith("-start") and instruction.shape.startswith("("):
        # An asynchronous start (GPU's collectives, copies): its tuple holds what it reads and what it writes.
        return hbm(instruction.shape)
    root = instruction
    operands = [hbm(shapes.get(operand, "")) for operand in instruction.operands]
    body = []
    if instruction.opcode == "fusion":
        body = computations.get(dict(_callees(instruction)).get("fused"), [])
        root = body[-1] if body else instruction  # the ROOT instruction is printed last
        for i, read in _sliced_parameters(body, computations).items():  # a fusion reading only a slice of an operand
            if i < len(operands):
                operands[i] = min(operands[i], read)
    if root.opcode == "dynamic-slice" and root is instruction:
        return 2 * hbm(instruction.shape) + sum(operands[1:])
    if root.opcode == "dynamic-update-slice" and root is instruction:
        return 2 * hbm(shapes.get(root.operands[1], "")) + sum(operands[2:])
    # Each array it writes; an update in place (a dynamic-update-slice among a fusion's results, under bitcasts)
    # writes its update and does not read the buffer it updates (the operand of its shape).
    outputs = _split_top_level(instruction.shape[1:-1]) if instruction.shape.startswith("(") else [instruction.shape]
    named = {i.name: i for i in body}
    results = [named.get(name) for name in root.operands] if root.opcode == "tuple" and body else [root]
    written, buffers = 0.0, set()
    for text, result in zip(outputs, results if len(results) == len(outputs) else [None] * len(outputs)):
        while result is not None and result.opcode == "bitcast":
            result = named.get(result.operands[0])
        if result is None or result is instruction or result.opcode != "dynamic-update-slice":
            written += hbm(text)
            continue
        written += 2 * hbm(shapes.get(result.operands[1], ""))
        buffers.update(next(([i] for i, operand in enumerate(instruction.operands)
                             if i not in buffers and _dims(shapes.get(operand, "")) == _dims(result.shape)), []))
    return written + sum(size for i, size in enumerate(operands) if i not in buffers)


def hlo_cost(hlo: str, mesh_axes: dict[str, int], granule_of: Callable[[int], int] = lambda device: 0) -> HloCost:
    """The cost of one call of the compiled SPMD program `hlo` for one device. mesh_axes: the mesh's axis sizes
    in order (device i of a group is the mesh's i-th device in row-major order, jit's device assignment);
    granule_of: the slice or host of the mesh's i-th device (groups spanning two are `remote`)."""
    computations, entry = _computations(hlo)
    runs, fused, unknown = _multiplicities(computations, entry)
    shapes = {i.name: i.shape for instructions in computations.values() for i in instructions}
    names, sizes = list(mesh_axes), list(mesh_axes.values())
    flops = hbm = 0.0
    calls = 0
    moved: dict[Collective, float] = defaultdict(float)
    arrays: Counter = Counter()
    for name, instructions in computations.items():
        count = runs.get(name, 0.0)
        if count == 0:
            continue
        for instruction in instructions:
            opcode = instruction.opcode
            matmul = _is_matmul(instruction)
            if matmul:
                flops += count * _dot_flops(instruction, shapes)
            calls += int(count) * (opcode == "custom-call" and not matmul)
            if name not in fused and opcode not in _NO_TRAFFIC:
                hbm += count * _traffic(instruction, shapes, computations)
            if name not in fused and opcode not in _ALIASES and (array := _ARRAY.match(instruction.shape)):
                origin = _OP_NAME.search(instruction.attributes)
                arrays[(int(_array_bytes(instruction.shape)), array.group(1), tuple(_dims(instruction.shape)), opcode,
                        _JIT_PREFIX.sub("", origin.group(1)) if origin else "")] += 1
            kind = opcode.removesuffix("-start")
            if kind not in COLLECTIVE_KINDS:
                continue
            groups = replica_groups(instruction.attributes)
            coordinates = [np.array(np.unravel_index(group, sizes)) for group in groups]
            axes = tuple(names[a] for a in range(len(names)) if any(len(set(c[a])) > 1 for c in coordinates))
            remote = any(len({granule_of(device) for device in group}) > 1 for group in groups)
            operand_bytes = sum(_array_bytes(shapes[operand]) for operand in instruction.operands)
            group_size = 2 if kind == "collective-permute" else max(len(group) for group in groups)
            moved[Collective(kind, axes, remote)] += count * collective_bytes(kind, operand_bytes, group_size)
    largest = sorted(arrays.items(), key=lambda item: -item[0][0])[:LARGEST_COUNT]
    return HloCost(flops, hbm, dict(moved), calls, unknown, tuple(LargeArray(*key, count=n) for key, n in largest))
