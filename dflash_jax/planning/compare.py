"""`dflash-jax plan --compare`: the target layouts and meshes a topology allows, each compiled and planned
(plan.py), ranked by predicted time per token among those that fit (design §13).

Candidates: every layout of sharding.TARGET_LAYOUTS (--layouts) times every tensor size of --tensor_sizes
that divides a slice or host; within one, the rest of its devices on fsdp; across slices or hosts (TPU
multi-slice, a GPU cluster) the data axis (mesh.dcn_data), so only data parallelism crosses the slow links. A
candidate whose target alone exceeds the memory budget, or whose rows do not split over its (data, fsdp)
shards, is listed with the reason and not compiled. The ranking is by the time a token takes (the step time
over the step's tokens: candidates with more (data, fsdp) shards take more rows a step when the batch is given
per device) with no overlap (the roofline's upper end), then with perfect overlap: the run's length for the
config's epochs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from flax import nnx
from ml_collections import ConfigDict

from dflash_jax.planning.chips import Chip, chip_of_kind
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.planning.plan import GIB, Plan, granule_of, plan_train_step, target_bytes_by_layout
from dflash_jax.planning.roofline import format_bytes, format_ranges, format_run
from dflash_jax.sharding import TARGET_LAYOUTS, make_mesh
from dflash_jax.train import validate
from dflash_jax.train.config import base_config
from dflash_jax.weights.families import family_of


class Candidate(NamedTuple):
    layout: str
    mesh: dict[str, int]  # data, fsdp, tensor within one slice or host, and dcn_data
    plan: Plan | None  # None when it was not compiled
    reason: str  # why not, or why it does not fit


def candidate_meshes(devices: int, granules: int, tensor_sizes: tuple[int, ...]) -> list[dict[str, int]]:
    per_granule = devices // granules
    return [dict(data=1, fsdp=per_granule // tensor, tensor=tensor, dcn_data=granules)
            for tensor in tensor_sizes if tensor <= per_granule and per_granule % tensor == 0]


def compare_plans(config: ConfigDict, target_config, devices: list, granules: int, layouts: tuple[str, ...],
                  tensor_sizes: tuple[int, ...], hbm_gib: float | None = None, chip: Chip | None = None,
                  devices_per_host: int | None = None, epoch_tokens: int | None = None) -> list[Candidate]:
    """Every candidate planned (or the reason it was not), best first."""
    chip = chip or chip_of_kind(devices[0].device_kind)
    found = []
    for sizes in candidate_meshes(len(devices), granules, tensor_sizes):
        rows = (sizes["data"] * sizes["dcn_data"]) * sizes["fsdp"]
        # data.rows_per_device: each candidate's batch is that many rows per (data, fsdp) shard of its own.
        candidate_config = validate.resolve_batch_size(ConfigDict(config.to_dict()), rows)
        candidate_config.mesh.update(sizes)
        micro_batch = candidate_config.data.batch_size // config.grad_accum_steps
        if micro_batch % rows:
            found.extend(Candidate(layout, sizes, None, f"{micro_batch} rows per micro-batch do not split over "
                                                        f"{rows} (data, fsdp) shards") for layout in layouts)
            continue
        mesh = make_mesh(**sizes, devices=devices)
        by_layout = _target_bytes(config, target_config, mesh)
        budget = hbm_gib if hbm_gib is not None else (chip.hbm_bytes / GIB if chip else None)
        for layout in layouts:
            if budget is not None and by_layout[layout] > budget * GIB:
                found.append(Candidate(layout, sizes, None, f"the target alone takes "
                                                            f"{by_layout[layout] / GIB:.1f} GiB per device"))
                continue
            candidate_config.target_layout = layout
            try:
                plan = plan_train_step(candidate_config, target_config, mesh, hbm_gib, chip, devices_per_host,
                                       epoch_tokens)
            except ConfigError as error:  # e.g. heads that tensor does not divide
                found.append(Candidate(layout, sizes, None, str(error)))
                continue
            fits = plan.hbm_bytes is None or plan.total_bytes <= plan.hbm_bytes
            found.append(Candidate(layout, sizes, plan, "" if fits else
                                   f"needs {plan.total_bytes / GIB:.1f} GiB of {plan.hbm_bytes / GIB:.1f}"))
    return sorted(found, key=_rank)


def is_default_mesh(config: ConfigDict) -> bool:
    """A mesh left as base_config gives it: train chooses one (design §13)."""
    return dict(config.mesh) == dict(base_config().mesh)


def choose_mesh(config: ConfigDict, target_config, devices: list, hbm_gib: float, chip: Chip,
                tensor_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[ConfigDict, Candidate, str]:
    """For a mesh left at its defaults: every candidate of `devices` (the data axis across their slices or hosts),
    in config.target_layout or, when "auto", every layout; the config with the best's mesh and layout, the best,
    and the comparison's table. A ConfigError when none fits."""
    layouts = TARGET_LAYOUTS if config.target_layout == "auto" else (config.target_layout,)
    granules = len({granule_of(device) for device in devices})
    candidates = compare_plans(config, target_config, devices, granules, layouts, tensor_sizes, hbm_gib, chip)
    table = format_comparison(candidates)
    if not candidates or not fits(candidates[0]):
        raise ConfigError(f"no mesh of the {len(devices)} devices fits the train step in {hbm_gib:.1f} GiB per "
                          f"device:\n{table}")
    best = candidates[0]
    chosen = ConfigDict(config.to_dict())
    chosen.mesh.update(best.mesh)
    chosen.target_layout = best.layout
    return chosen, best, table


def _target_bytes(config: ConfigDict, target_config, mesh) -> dict[str, int]:
    attention_impl = resolve_attention_impl(config.attention_impl, mesh.devices.flat[0].platform)
    target = family_of(target_config).abstract_model(
        target_config, param_dtype=validate.dtype_of(config.target_dtype), attention_impl=attention_impl, mesh=mesh)
    return target_bytes_by_layout(nnx.state(target), mesh)


def fits(candidate: Candidate) -> bool:
    """Compiled, within the budget, and with a predicted time (the chip's peaks known)."""
    return _rank(candidate)[0] == 0


def _rank(candidate: Candidate) -> tuple:
    plan = candidate.plan
    if plan is None or candidate.reason or plan.roofline is None:
        return (1, candidate.plan is None, math.inf, math.inf)
    # Per token: with data.rows_per_device a candidate's batch grows with its (data, fsdp) shards, so a shorter
    # step may carry fewer tokens; for the config's epochs the run's length is what counts.
    fastest, slowest = plan.roofline.step_seconds
    tokens = plan.roofline.tokens_per_step
    return (0, False, slowest / tokens, fastest / tokens)


def _mesh_text(sizes: dict[str, int]) -> str:
    return ",".join(f"{axis}={size}" for axis, size in sizes.items())


def format_comparison(candidates: list[Candidate]) -> str:
    lines = ["| layout | mesh (per slice or host) | memory per device | bytes per device on each link | step "
             "(overlap - none) | MFU | tokens/s | run | bound | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for candidate in candidates:
        plan, mesh = candidate.plan, _mesh_text(candidate.mesh)
        if plan is None or plan.roofline is None:
            lines.append(f"| {candidate.layout} | {mesh} | | | | | | | | {candidate.reason or 'no chip peaks'} |")
            continue
        line = plan.roofline
        links = ", ".join(f"{name} {format_bytes(size)}" for name, size in line.link_bytes.items())
        step, mfu, tokens = format_ranges(line)
        lines.append(f"| {candidate.layout} | {mesh} | {format_bytes(plan.total_bytes)} | {links} | {step} | {mfu} | "
                     f"{tokens} | {format_run(line)} | {line.bound} | {candidate.reason} |")
    best = candidates[0] if candidates and fits(candidates[0]) else None
    if best is None:
        lines.append("no candidate fits")
    else:
        flags = " ".join(f"--config.mesh.{axis}={size}" for axis, size in best.mesh.items())
        lines.append(f"best: --config.target_layout={best.layout} {flags}")
    return "\n".join(lines)


def parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def check_layouts(text: str) -> tuple[str, ...]:
    layouts = tuple(part.strip() for part in text.split(","))
    unknown = [layout for layout in layouts if layout not in TARGET_LAYOUTS]
    if unknown:
        raise ConfigError(f"--layouts: unknown layouts {unknown}; the layouts are {list(TARGET_LAYOUTS)}")
    return layouts
