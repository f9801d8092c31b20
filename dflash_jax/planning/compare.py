"""`dflash-jax plan --compare`: the target layouts and meshes a topology allows, each predicted without
compiling (analytic.py), then those that could win compiled and planned (plan.py), ranked by predicted time per
token among those that fit (design §13.1).

Candidates: every layout of sharding.TARGET_LAYOUTS (--layouts) times every tensor size of --tensor_sizes and
context split of --context_sizes (by default those the row length makes worth it, design §19) that divide a
slice or host; within one, the rest of its devices on fsdp; across slices or hosts (TPU
multi-slice, a GPU cluster) the data axis (mesh.dcn_data), so only data parallelism crosses the slow links. A
candidate predicted not to fit the memory budget, or whose rows do not split over its (data, fsdp) shards, is
listed with the reason and not compiled; with a margin, neither is one whose predicted time per token is more
than that factor over the best prediction's (listed as predicted only). The ranking is by the time a token
takes (roofline.Roofline.per_token): the compiled candidates that fit, then those predicted only.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

from ml_collections import ConfigDict

from dflash_jax.planning import analytic
from dflash_jax.planning.analytic import Prediction, mesh_text
from dflash_jax.planning.chips import Chip, chip_of_kind
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.planning.plan import GIB, Plan, granule_of, plan_train_step
from dflash_jax.planning.roofline import format_bytes, format_ranges, format_run
from dflash_jax.sharding import TARGET_LAYOUTS, make_mesh
from dflash_jax.train.config import base_config

log = logging.getLogger(__name__)


class Candidate(NamedTuple):
    layout: str
    mesh: dict[str, int]  # data, fsdp, tensor, context within one slice or host, and dcn_data
    plan: Plan | None  # None when it was not compiled
    reason: str  # why not, or why it does not fit
    prediction: Prediction | None = None  # the analytical one (analytic.py)


def compare_plans(config: ConfigDict, target_config, devices: list, granules: int, layouts: tuple[str, ...],
                  tensor_sizes: tuple[int, ...], hbm_gib: float | None = None, chip: Chip | None = None,
                  devices_per_host: int | None = None, epoch_tokens: int | None = None,
                  margin: float | None = None, context_sizes: tuple[int, ...] | None = None) -> list[Candidate]:
    """Every candidate, best first: compiled where it is predicted to fit and, with a margin, to take at most
    `margin` times the time per token predicted for the best candidate that fits once compiled (until one does,
    every candidate predicted to fit is compiled); the others with their prediction only."""
    chip = chip or chip_of_kind(devices[0].device_kind)
    budget = hbm_gib if hbm_gib is not None else (chip.hbm_bytes / GIB if chip else None)
    predictions = analytic.predict_candidates(config, target_config, devices, granules, layouts, tensor_sizes,
                                              None if budget is None else budget * GIB, chip, context_sizes)
    best = None  # the prediction of the best candidate that fits once compiled: the margin counts from it
    found, compiled = [], {}  # (mesh, predicted times) -> the layout compiled for them
    for prediction in predictions:
        line = prediction.roofline
        ratio = line.per_token[0] / best.per_token[0] if best is not None and line is not None else 1.0
        if not prediction.fits or (margin is not None and ratio > margin):
            found.append(Candidate(prediction.layout, prediction.mesh, None, prediction.reason or
                                   f"predicted only: {ratio:.2f}x the best prediction", prediction))
            continue
        same = (tuple(prediction.mesh.values()), line and line.per_token)
        if margin is not None and line is not None and same in compiled:  # ranked after it: more memory
            found.append(Candidate(prediction.layout, prediction.mesh, None, f"predicted only: the same time as "
                                   f"{compiled[same]} on this mesh, in more memory", prediction))
            continue
        compiled[same] = prediction.layout
        found.append(_compiled(prediction, target_config, devices, hbm_gib, chip, devices_per_host, epoch_tokens))
        if best is None and fits(found[-1]):
            best = line
    return sorted(found, key=_rank)


def _compiled(prediction: Prediction, target_config, devices: list, hbm_gib: float | None, chip: Chip | None,
              devices_per_host: int | None, epoch_tokens: int | None) -> Candidate:
    mesh = make_mesh(**prediction.mesh, devices=devices)
    try:
        plan = plan_train_step(prediction.config, target_config, mesh, hbm_gib, chip, devices_per_host, epoch_tokens)
        plan = plan._replace(executable=None)  # a comparison runs no step: its candidates' programs are let go
    except ConfigError as error:  # e.g. heads that tensor does not divide
        return Candidate(prediction.layout, prediction.mesh, None, str(error), prediction)
    fits = plan.hbm_bytes is None or plan.total_bytes <= plan.hbm_bytes
    return Candidate(prediction.layout, prediction.mesh, plan, "" if fits else
                     f"needs {plan.total_bytes / GIB:.1f} GiB of {plan.hbm_bytes / GIB:.1f}", prediction)


def chooses_mesh(config: ConfigDict) -> bool:
    """Whether train chooses the mesh (design §13.1): config.choose_mesh, or where that is None, whether the mesh
    is left as base_config gives it."""
    if config.get("choose_mesh") is not None:
        return config.choose_mesh
    return dict(config.mesh) == dict(base_config().mesh)


def choose_mesh(config: ConfigDict, target_config, devices: list, hbm_gib: float, chip: Chip,
                tensor_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[ConfigDict, Plan, str]:
    """For a mesh left at its defaults: every candidate of `devices` (the data axis across their slices or hosts;
    the row split over context where the row length makes it worth trying, analytic.context_sizes_for), in
    config.target_layout or, when "auto", every layout, predicted without compiling (analytic.py); the best
    compiled and planned, or, should its plan not fit after all, the next. The config with the chosen mesh and
    layout, its plan, and one line naming the choice and why. A ConfigError when none fits."""
    layouts = TARGET_LAYOUTS if config.target_layout == "auto" else (config.target_layout,)
    granules = len({granule_of(device) for device in devices})
    predictions = analytic.predict_candidates(config, target_config, devices, granules, layouts, tensor_sizes,
                                              hbm_gib * GIB, chip)
    for prediction in (p for p in predictions if p.fits):
        chosen = ConfigDict(config.to_dict())
        chosen.mesh.update(prediction.mesh)
        chosen.target_layout = prediction.layout
        mesh = make_mesh(**prediction.mesh, devices=devices)
        try:
            plan = plan_train_step(chosen, target_config, mesh, hbm_gib, chip)
        except ConfigError as error:  # e.g. heads that tensor does not divide
            log.warning("%s on %s: %s; trying the next candidate", prediction.layout, mesh_text(prediction.mesh), error)
            continue
        if plan.total_bytes <= plan.hbm_bytes:
            return chosen, plan, analytic.format_choice(prediction, predictions)
        log.warning("%s on %s, predicted to fit, needs %.2f GiB per device; trying the next candidate",
                    prediction.layout, mesh_text(prediction.mesh), plan.total_bytes / GIB)
    reasons = "; ".join(f"{p.layout} {mesh_text(p.mesh)}: {p.reason or 'over the budget once compiled'}"
                        for p in predictions)
    raise ConfigError(f"no mesh of the {len(devices)} devices fits the train step in {hbm_gib:.1f} GiB per "
                      f"device ({reasons})")


def fits(candidate: Candidate) -> bool:
    """Compiled, within the budget, and with a predicted time (the chip's peaks known)."""
    return candidate.plan is not None and not candidate.reason and candidate.plan.roofline is not None


def _rank(candidate: Candidate) -> tuple:
    """The compiled candidates that fit by their plan's time per token, then those predicted only by their
    prediction's (with analytic.rank_key's ties), then the rest."""
    plan, prediction = candidate.plan, candidate.prediction
    ties = analytic.rank_key(prediction)[3:] if prediction is not None else ()
    if fits(candidate):
        return (0, *plan.roofline.per_token, *ties)
    if plan is None and prediction is not None and prediction.fits and prediction.roofline is not None:
        return (1, *prediction.roofline.per_token, *ties)
    return (2, math.inf, math.inf, *ties)


def format_comparison(candidates: list[Candidate]) -> str:
    """The candidates as a Markdown table, best first, with a column of where a mixture-of-experts target's
    experts lie in each (analytic.expert_placement)."""
    experts = any(c.prediction is not None and c.prediction.experts for c in candidates)
    lines = ["| layout | mesh (per slice or host) |" + " experts |" * experts + " memory per device | bytes per "
             "device on each link | step (overlap - none) | MFU | tokens/s | run | bound | from | note |",
             "| --- | --- |" + " --- |" * experts + " --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for candidate in candidates:
        plan, prediction, mesh = candidate.plan, candidate.prediction, mesh_text(candidate.mesh)
        if experts:
            mesh += f" | {prediction.experts if prediction is not None else ''}"
        if plan is not None and plan.roofline is not None:
            total, line, source = plan.total_bytes, plan.roofline, "compiled"
        elif plan is None and prediction is not None and prediction.roofline is not None:
            total, line, source = prediction.memory["total"], prediction.roofline, "predicted"
        else:
            source = "compiled" if plan is not None else ""
            lines.append(f"| {candidate.layout} | {mesh} | | | | | | | | {source} | "
                         f"{candidate.reason or 'no chip peaks'} |")
            continue
        links = ", ".join(f"{name} {format_bytes(size)}" for name, size in line.link_bytes.items())
        step, mfu, tokens = format_ranges(line)
        lines.append(f"| {candidate.layout} | {mesh} | {format_bytes(total)} | {links} | {step} | {mfu} | "
                     f"{tokens} | {format_run(line)} | {line.bound} | {source} | {candidate.reason} |")
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
