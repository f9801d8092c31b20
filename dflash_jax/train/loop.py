"""The training loop, top to bottom: config -> target -> drafter -> data (train/startup.py) -> steps -> logs
and checkpoints (`run_loop`).

Rerunning the same command with the same workdir resumes from the newest checkpoint exactly: same drafter
weights and optimizer state, same RNG, same next data batch (design §7).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx
from ml_collections import ConfigDict
from tqdm import tqdm

from dflash_jax.data import merge_states
from dflash_jax.eval.train_hook import make_train_evaluator
from dflash_jax.models.drafter import Drafter
from dflash_jax.runtime import distributed
from dflash_jax.runtime.paths import as_path
from dflash_jax.runtime.stop import StopRequest
from dflash_jax.runtime.workdir import MetricsLog, workdir_held
from dflash_jax.train import epochs, startup, validate
from dflash_jax.train.loss import acceptance_metrics
from dflash_jax.train.state import TrainState
from dflash_jax.train.step import put_batch
from dflash_jax.train.tracking import Trackers

log = logging.getLogger(__name__)

# evaluate(step, drafter, target) -> metrics to log under "eval/<name>"; called every config.eval_every steps.
EvaluateFn = Callable[[int, Drafter, nnx.Module], dict[str, float]]


def train(config: ConfigDict, workdir: str | os.PathLike, evaluate: EvaluateFn | None = None) -> dict[str, Any]:
    """Train (or resume) the run in `workdir` (a local path or a bucket URI such as gs://bucket/run); returns
    the summary that is also logged at the end.

    evaluate: called every config.eval_every steps; by default exact τ on config.data.eval_files (design §9).
    The run holds the workdir's lock throughout (runtime/workdir.py): a second trainer there is refused. A
    refused start (bad config, data, or a resume that does not fit the checkpoint) writes no run files.
    """
    config = validate.run_config(config)  # the run's own copy: the caller's config stays as given
    validate.validate_config(config)
    validate.validate_data_files(config)
    given = config.copy_and_resolve_references()  # as given and checked, for the history; settled below
    if evaluate is None and config.eval_every:
        validate.validate_eval_files(config)
        evaluate = make_train_evaluator(config)  # logged as eval/* metrics
    workdir = as_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with workdir_held(workdir):
        return run_loop(startup.setup(given, startup.settle(config, workdir), workdir), evaluate)


def run_loop(run: startup.TrainingRun, evaluate: EvaluateFn | None) -> dict[str, Any]:
    """The steps from run.start_step to config.total_steps (or a stop), with their logs, evaluations and
    checkpoints; closes the run's files and returns the summary."""
    config, state, step = run.config, run.state, run.start_step
    records = _Records(run)
    pending: list[dict[str, jax.Array]] = []  # device metrics since the last log line (no host sync per step)
    history: list[dict[str, Any]] = []
    interval_start, interval_steps, compile_seconds = time.perf_counter(), 0, None
    progress = tqdm(total=config.total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                    disable=not run.main)
    stopping, vote = False, distributed.StopVote()
    profile = _Profile(config.profile_steps, run.workdir / "profile")
    # A stop's grace budget runs from its signal to the end of the files' closing below, the checkpoint save's
    # wait included (design §7.3).
    with StopRequest(config.stop_grace_seconds, run.checkpointer.resume_point) as stop:
        try:
            while step < config.total_steps and not stopping:
                batch, data_position = next(run.batches)
                profile.before(step + 1)
                batch = put_batch(batch, run.mesh, run.rows, config.data.batch_size)
                state, metrics = run.step_fns.train_step(state, run.target_state, batch, run.total_steps)
                step += 1
                profile.after(step, metrics)
                interval_steps += 1
                pending.append(metrics)
                progress.update(1)

                if compile_seconds is None:  # the first step includes compilation; keep it out of step times
                    jax.block_until_ready(metrics)
                    compile_seconds = time.perf_counter() - interval_start
                    log.info("first step (compilation included) took %.1f s", compile_seconds)
                    interval_start, interval_steps = time.perf_counter(), 0

                if step % config.log_every == 0 or step == config.total_steps:
                    record = _log_record(run, step, pending, interval_start, interval_steps, data_position)
                    records.write(record)
                    history.append(record)
                    progress.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau_est']:.2f}")
                    log.info(_log_line(record))
                    pending, interval_start, interval_steps = [], time.perf_counter(), 0

                if evaluate is not None and config.eval_every and step % config.eval_every == 0:
                    eval_start = time.perf_counter()
                    _evaluate(run, evaluate, step, state, records)
                    interval_start += time.perf_counter() - eval_start  # step times exclude evaluation

                # Every process stops after the same step, also when a signal reached only some of them.
                stopping = vote(stop.requested is not None)
                if stopping:
                    stop.start_grace()  # a stop another process received: the budget starts here
                    log.warning("stopping after step %d: saving its checkpoint", step)
                if step % config.checkpoint_every == 0 or step == config.total_steps or stopping:
                    run.checkpointer.save(step, state, merge_states(distributed.gather_json(data_position)))
            stopped_by = (stop.requested or "a stop on another process") if stopping else None
            if stopped_by:
                log.warning("stopped by %s at step %d; rerun the same command to resume", stopped_by, step)
        finally:
            progress.close()
            run.checkpointer.close()
            records.close()
            run.batches.close()

    summary = {"start_step": run.start_step, "final_step": step, "stopped_by": stopped_by,
               "compile_seconds": compile_seconds, "last": history[-1] if history else None}
    log.info("summary: %s", json.dumps(summary))
    return summary


def use_compilation_cache(config: ConfigDict, workdir: str | os.PathLike | None) -> None:
    """XLA's persistent compilation cache in config.compilation_cache_dir; left unset, JAX's own setting
    (JAX_COMPILATION_CACHE_DIR) where there is one, else <workdir>/compilation_cache (without a workdir, as
    `evaluate --drafter`, none). "off" turns it off, JAX's setting included. The setting is process-wide and read
    once, at the first compilation, so the train and evaluate commands set it before anything compiles; `train`
    itself leaves it alone."""
    if config.compilation_cache_dir == "off":
        jax.config.update("jax_compilation_cache_dir", None)
        return
    directory = config.compilation_cache_dir or jax.config.jax_compilation_cache_dir or (
        as_path(workdir) / "compilation_cache" if workdir else None)
    if directory is None:
        return
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    log.debug("compilation cache: %s", directory)  # before a bad input's one error line: not on the console


class _Profile:
    """A jax.profiler trace of steps first..last of config.profile_steps (None: no trace)."""

    def __init__(self, steps: tuple[int, int] | None, directory: epath.Path):
        self.first, self.last = steps if steps else (None, None)
        self.directory = directory

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(os.fspath(self.directory))

    def after(self, step: int, metrics: dict[str, jax.Array]) -> None:
        if step == self.last:
            jax.block_until_ready(metrics)  # the trace holds the device work of its last step
            jax.profiler.stop_trace()
            log.info("profile of steps %d-%d written under %s", self.first, self.last, self.directory)


class _Records:
    """The run's log records: one metrics file per run, and the trackers (TensorBoard, W&B: tracking.py). The
    other processes compute the same (replicated) records and drop them."""

    def __init__(self, run: startup.TrainingRun):
        self.metrics_log = MetricsLog(run.workdir) if run.main else None
        self.trackers = Trackers(run.workdir, run.config, run.start_step) if run.main else None

    def write(self, record: dict[str, Any]) -> None:
        if self.metrics_log is not None:
            self.metrics_log.write(record)
        if self.trackers is not None:
            self.trackers.write(record["step"], record)

    def close(self) -> None:
        if self.metrics_log is not None:
            self.metrics_log.close()
        if self.trackers is not None:
            self.trackers.close()


def _evaluate(run: startup.TrainingRun, evaluate: EvaluateFn, step: int, state: TrainState, records: _Records) -> None:
    """The evaluation hook on the drafter of `state`, its metrics logged under "eval/<name>"."""
    eval_metrics = evaluate(step, nnx.merge(run.spec.graphdef, state.params), run.target)
    if eval_metrics:
        log.info("eval at step %d: %s", step, json.dumps(eval_metrics))
        records.write({"step": step, **{f"eval/{name}": value for name, value in eval_metrics.items()}})


def _log_record(run: startup.TrainingRun, step: int, pending: list[dict[str, jax.Array]], interval_start: float,
                interval_steps: int, data_position: Any) -> dict[str, Any]:
    """Mean loss/grad norm and pooled slot accuracies from run.first_slot over the steps since the last log line
    (design §6), DSpark's confidence and DFlash2's selector loss where the step reports them (design §18), the
    data's progress over every process (design §7), and the predicted step time where the step was planned."""
    host = jax.device_get(pending)
    elapsed = time.perf_counter() - interval_start
    step_time = elapsed / interval_steps if interval_steps else None
    tokens_per_step = run.config.data.batch_size * run.config.data.seq_len
    record = {
        "step": step,
        "loss": float(np.mean([m["loss"] for m in host])),
        **acceptance_metrics(np.sum([m["slot_correct"] for m in host], axis=0),
                             np.sum([m["slot_count"] for m in host], axis=0), run.first_slot),
        "anchor_utilisation": float(np.mean([m["anchor_utilisation"] for m in host])),
        "grad_norm": float(np.mean([m["grad_norm"] for m in host])),
        "learning_rate": float(host[-1]["learning_rate"]),
        "step_time": step_time,
        "tokens_per_second": tokens_per_step / step_time if step_time else None,
        "mfu": (run.step_flops / step_time / (run.peak_tflops * 1e12 * run.mesh.size)
                if step_time and run.peak_tflops else None),
    }
    for name in ("confidence_loss", "selector_loss"):  # DSpark's and DFlash2's own terms (design §18)
        if name in host[0]:
            record[name] = float(np.mean([m[name] for m in host]))
    record.update(epochs.data_progress(distributed.gather_json(data_position)))
    if run.predicted is not None:
        record["predicted_step_time"] = list(run.predicted)
    return record


def _log_line(record: dict[str, Any]) -> str:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    return (f"step {record['step']}: loss {record['loss']:.4f}  tau_est {record['tau_est']:.3f}  "
            f"acc_1 {record['acc_1']:.3f}  util {record['anchor_utilisation']:.3f}  "
            f"grad_norm {record['grad_norm']:.3f}  lr {record['learning_rate']:.2e}  epoch {record['epoch']:.3f}  "
            f"step {fmt(record['step_time'], '.3f')} s  {fmt(record['tokens_per_second'], ',.0f')} tok/s  "
            f"mfu {fmt(record['mfu'], '.1%')}"
            + ("  (predicted step {:.3f}-{:.3f} s)".format(*record["predicted_step_time"])
               if "predicted_step_time" in record else ""))
