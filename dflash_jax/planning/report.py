"""`plan --json FILE`: every figure the plan's tables print, machine-readable (design §13).

One record per planned step (`plan_record`); `plan --compare` writes one per candidate, best first, with the
reason a candidate was not compiled or does not fit, and its analytical prediction (analytic.py). Bytes are
per device; FLOPs as the tables give them (the model's count for all devices and per device, the compiler's
per device); times in seconds. Every time, MFU and tokens/s is a prediction of the roofline (roofline.py), as
a [perfect overlap, no overlap] pair where the table shows a range.
"""

from __future__ import annotations

import json
import math

from dflash_jax.planning.analytic import Prediction
from dflash_jax.planning.compare import Candidate, fits
from dflash_jax.planning.plan import Plan
from dflash_jax.runtime.paths import as_path


def plan_record(plan: Plan) -> dict:
    devices = math.prod(plan.mesh.values())
    record = {
        "backend": plan.backend, "device_kind": plan.device_kind, "mesh": plan.mesh,
        "rows_per_device": plan.rows_per_device, "target_layout": plan.target_layout,
        "memory_bytes": {"target_weights": plan.target_bytes, "drafter_parameters": plan.params_bytes,
                         "optimizer_state": plan.opt_state_bytes, "batch": plan.batch_bytes,
                         "arguments": plan.argument_bytes, "temporaries": plan.temp_bytes,
                         "generated_code": plan.code_bytes, "total": plan.total_bytes, "budget": plan.hbm_bytes},
        "target_bytes_by_layout": plan.target_bytes_by_layout,
        "largest_arrays": [{"bytes": array.bytes, "dtype": array.dtype, "shape": list(array.shape), "op": array.op,
                            "origin": array.origin, "count": array.count} for array in plan.largest],
        "flops": {"model_all_devices": plan.model_flops, "model_per_device": plan.model_flops / devices,
                  "compiler_per_device": plan.cost.flops, "cost_analysis_per_device": plan.xla_flops},
        "hbm_traffic_bytes": plan.cost.hbm_bytes,
        "collective_bytes": [{"kind": collective.kind, "axes": list(collective.axes), "remote": collective.remote,
                              "bytes": size}
                             for collective, size in sorted(plan.cost.collective_bytes.items(), key=lambda i: -i[1])
                             if size],
        "kernel_calls": plan.cost.custom_calls, "unknown_loops": plan.cost.unknown_loops,
        "prediction": None,
    }
    line = plan.roofline
    if line is not None:
        fastest, slowest = line.step_seconds
        record["prediction"] = {
            "chip": line.chip.name, "seconds_by_resource": line.seconds, "link_bytes": line.link_bytes,
            "bound": line.bound, "step_seconds": [fastest, slowest], "mfu": [line.mfu(fastest), line.mfu(slowest)],
            "tokens_per_second": [line.tokens_per_step / fastest, line.tokens_per_step / slowest],
            "tokens_per_step": line.tokens_per_step, "steps": line.steps,
            "run_seconds": None if line.steps is None else [fastest * line.steps, slowest * line.steps]}
    return record


def prediction_record(prediction: Prediction | None) -> dict | None:
    """A candidate's analytical prediction (analytic.py): bytes per device by part, and the step time as a
    [perfect overlap, no overlap] pair where the chip's peaks are known."""
    if prediction is None:
        return None
    line = prediction.roofline
    return {"memory_bytes": prediction.memory, "fits": prediction.fits, "experts": prediction.experts or None,
            "step_seconds": None if line is None else list(line.step_seconds),
            "seconds_by_resource": None if line is None else line.seconds}


def comparison_record(candidates: list[Candidate]) -> dict:
    """The candidates as `format_comparison` ranks them, and the best that fits (None when none does)."""
    best = candidates[0] if candidates and fits(candidates[0]) else None
    return {"candidates": [{"layout": candidate.layout, "mesh": candidate.mesh, "note": candidate.reason,
                            "fits": fits(candidate), "compiled": candidate.plan is not None,
                            "plan": None if candidate.plan is None else plan_record(candidate.plan),
                            "predicted": prediction_record(candidate.prediction)}
                           for candidate in candidates],
            "best": None if best is None else {"layout": best.layout, "mesh": best.mesh}}


def write_json(path: str, record: dict) -> None:
    as_path(path).write_text(json.dumps(record, indent=1) + "\n")
