"""The training loop, top to bottom: config -> target -> drafter -> data -> steps -> logs and checkpoints.

Rerunning the same command with the same workdir resumes from the newest checkpoint exactly: same drafter
weights and optimizer state, same RNG, same next data batch (design §7).
"""

from __future__ import annotations

import dataclasses
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
from transformers import AutoTokenizer

from dflash_jax.planning import compare as plan_compare, plan
from dflash_jax.planning.chips import chip_of_kind
from dflash_jax.data import BatchLoader, Prefetcher, merge_states
from dflash_jax.runtime.errors import ConfigError, DataError
from dflash_jax.eval.train_hook import make_train_evaluator
from dflash_jax.models.drafter import Drafter
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.sharding import BATCH_AXES, auto_target_layout, state_shardings
from dflash_jax.runtime import distributed
from dflash_jax.train import epochs, flops, validate
from dflash_jax.runtime.stop import StopRequest
from dflash_jax.train.checkpoint import Checkpointer
from dflash_jax.train.loss import acceptance_metrics
from dflash_jax.train.state import init_train_state, state_spec
from dflash_jax.train.step import make_step, process_rows, put_batch
from dflash_jax.train.tracking import Trackers
from dflash_jax.runtime.workdir import MetricsLog, append_config_history, drop_metrics_after, workdir_held
from dflash_jax.weights.drafter_files import DRAFTER_CONFIG_FILE, workdir_path
from dflash_jax.weights.hub import pretrained_dir
from dflash_jax.weights.targets import load_target

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
    validate.validate_config(config)
    validate.validate_data_files(config)
    if evaluate is None and config.eval_every:
        validate.validate_eval_files(config)
        evaluate = make_train_evaluator(config)  # logged as eval/* metrics
    workdir = workdir_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with workdir_held(workdir):
        return _train(config, workdir, evaluate)


def _train(config: ConfigDict, workdir: epath.Path, evaluate: EvaluateFn | None) -> dict[str, Any]:
    given = config  # as the user gave it, for the history; the layout, rows per device and epochs resolve below
    config = config.copy_and_resolve_references()  # in a copy: the caller's config stays as given
    main = jax.process_index() == 0  # of several processes (runtime/distributed.py), one writes the run files
    budget = config.hbm_gib or plan.device_memory_gib(jax.local_devices()[0])
    report = None
    chip = chip_of_kind(jax.devices()[0].device_kind)  # the published peaks a predicted step time needs
    if budget and chip and jax.device_count() > 1 and plan_compare.is_default_mesh(config):
        # A mesh left at its defaults on accelerators: the candidates compiled and ranked by predicted time per
        # token (design §13; the compiles land in the persistent cache, so a resumed run repeats none of them).
        config, best, table = plan_compare.choose_mesh(config, plan.target_architecture(config), jax.devices(),
                                                       budget, chip)
        log.info("config.mesh left at its defaults: the candidates ranked by predicted time per token\n%s", table)
        report = best.plan
    mesh = validate.mesh_from_config(config)
    batch_shards = int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))
    config = validate.resolve_batch_size(config, batch_shards)
    validate.validate_batch_layout(config, batch_shards)

    # The step compiled from abstract arrays first (dflash_jax/planning/plan.py), where there is a budget to hold it to:
    # a run that cannot fit stops before any weight is read.
    predicted = None  # the roofline's (perfect overlap, no overlap) step time, logged beside the measured one
    if config.plan_only or budget:
        report = report or plan.plan_train_step(config, plan.target_architecture(config), mesh, budget)
        log.info("plan:\n%s", plan.format_plan(report))
        plan.check_budget(report)
        predicted = report.roofline.step_seconds if report.roofline is not None else None
        config.target_layout = report.target_layout  # "auto" settled by the plan
        if config.plan_only:
            return {"plan_total_gib": report.total_bytes / plan.GIB, "plan_temp_gib": report.temp_bytes / plan.GIB}

    if config.target_layout == "auto":  # no plan ran: the devices report no memory (sharding.auto_target_layout)
        config.target_layout = auto_target_layout({}, None)

    # The frozen target and its tokenizer; the drafter's architecture follows from them and the config. One
    # attention backend for both models' full-sequence attention.
    attention_impl = resolve_attention_impl(config.attention_impl)
    log.info("loading target %s onto mesh %s (layout: %s, attention: %s)", config.target_dir, dict(mesh.shape),
             config.target_layout, attention_impl)
    target, target_config = load_target(config.target_dir, param_dtype=validate.dtype_of(config.target_dtype),
                                        mesh=mesh, attention_impl=attention_impl, target_layout=config.target_layout)
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir(config.tokenizer_dir or config.target_dir))
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer)
    _check_drafter_config(workdir / DRAFTER_CONFIG_FILE, drafter_config)
    log.info("drafter: %s (attention: %s)", drafter_config, attention_impl)

    # Train state: restored from the newest checkpoint, else freshly initialised.
    spec = state_spec(drafter_config, config, attention_impl, mesh)
    checkpointer = Checkpointer(workdir, config.keep_checkpoints)
    restored = checkpointer.restore_latest(spec.abstract)  # the newest readable one (checkpoint.py)
    if restored is None:
        state, data_state = init_train_state(drafter_config, config, attention_impl, spec), None
        start_step = 0
    else:
        start_step, state, data_state = restored
        log.info("resuming from %s at step %d", workdir / "checkpoints", start_step)

    # This process's rows of every batch, built in a background thread (data/loader.py, data/prefetch.py).
    data = config.data
    rows = process_rows(mesh, data.batch_size)
    loader = _agreed(lambda: BatchLoader(
        data.train_files, tokenizer, seq_len=data.seq_len, anchor_stride=data.anchor_stride,
        batch_size=data.batch_size, rows=rows, seed=data.shuffle_seed, pad_id=tokenizer.pad_token_id or 0,
        max_positions=target_config.max_position_embeddings,
        bad_records=data.bad_records, chat_template_kwargs=data.chat_template_kwargs, state=data_state))
    config = epochs.resolve_total_steps(config, workdir, loader, main)  # before the loader's thread reads
    if main:  # the start is accepted: record it, and forget the metrics of steps the resume repeats
        _write_drafter_config(workdir / DRAFTER_CONFIG_FILE, drafter_config)
        append_config_history(workdir, given, start_step)
        drop_metrics_after(workdir, start_step)
    batches = Prefetcher(loader)

    target_graphdef, target_state = nnx.split(target)
    target_shardings = state_shardings(target_state, mesh, config.target_layout)
    step_fns = make_step(config, drafter_config, spec, target_graphdef, target_shardings, mesh)
    step_flops = flops.train_step_flops(config, target_config, drafter_config)
    peak = flops.peak_tflops(config, jax.devices()[0])
    tokens_per_step = config.data.batch_size * config.data.seq_len

    # One metrics file per run: the other processes compute the same (replicated) records and drop them.
    metrics_log = MetricsLog(workdir) if main else None
    trackers = Trackers(workdir, config, start_step) if main else None  # TensorBoard, W&B (tracking.py)

    def write_metrics(record: dict[str, Any]) -> None:
        if metrics_log is not None:
            metrics_log.write(record)
        if trackers is not None:
            trackers.write(record["step"], record)
    pending: list[dict[str, jax.Array]] = []  # device metrics since the last log line (no host sync per step)
    history: list[dict[str, Any]] = []
    interval_start, interval_steps, compile_seconds = time.perf_counter(), 0, None
    step = start_step
    progress = tqdm(total=config.total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                    disable=not main)
    stopping, vote = False, distributed.StopVote()
    profile = _Profile(config.profile_steps, workdir / "profile")
    try:
        with StopRequest() as stop:
            while step < config.total_steps and not stopping:
                batch, data_position = next(batches)
                profile.before(step + 1)
                state, metrics = step_fns.train_step(state, target_state, put_batch(batch, mesh, rows, data.batch_size))
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
                    record = _log_record(step, pending, interval_start, interval_steps, tokens_per_step,
                                         step_flops, peak, mesh.size)
                    record.update(epochs.data_progress(distributed.gather_json(data_position)))
                    if predicted is not None:
                        record["predicted_step_time"] = list(predicted)
                    write_metrics(record)
                    history.append(record)
                    progress.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau_est']:.2f}")
                    log.info(_log_line(record))
                    pending, interval_start, interval_steps = [], time.perf_counter(), 0

                if evaluate is not None and config.eval_every and step % config.eval_every == 0:
                    eval_start = time.perf_counter()
                    eval_metrics = evaluate(step, nnx.merge(spec.graphdef, state.params), target)
                    interval_start += time.perf_counter() - eval_start  # step times exclude evaluation
                    if eval_metrics:
                        log.info("eval at step %d: %s", step, json.dumps(eval_metrics))
                        write_metrics({"step": step, **{f"eval/{name}": value for name, value in eval_metrics.items()}})

                # Every process stops after the same step, also when a signal reached only some of them.
                stopping = vote(stop.requested is not None)
                if step % config.checkpoint_every == 0 or step == config.total_steps or stopping:
                    checkpointer.save(step, state, merge_states(distributed.gather_json(data_position)))
            stopped_by = (stop.requested or "a stop on another process") if stopping else None
            if stopped_by:
                log.warning("stopped by %s at step %d; rerun the same command to resume", stopped_by, step)
    finally:
        progress.close()
        checkpointer.close()
        if metrics_log is not None:
            metrics_log.close()
        if trackers is not None:
            trackers.close()
        batches.close()

    summary = {"start_step": start_step, "final_step": step, "stopped_by": stopped_by,
               "compile_seconds": compile_seconds, "last": history[-1] if history else None}
    log.info("summary: %s", json.dumps(summary))
    return summary



def use_compilation_cache(config: ConfigDict, workdir: str | os.PathLike | None) -> None:
    """XLA's persistent compilation cache in config.compilation_cache_dir (default <workdir>/compilation_cache;
    without a workdir, as `evaluate --drafter`, none unless that is set). The setting is process-wide and read
    once, at the first compilation, so the train and evaluate commands set it before anything compiles; `train`
    itself leaves it alone."""
    if config.compilation_cache_dir == "off" or not (config.compilation_cache_dir or workdir):
        return
    directory = config.compilation_cache_dir or workdir_path(workdir) / "compilation_cache"
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


def _agreed(build: Callable[[], BatchLoader]) -> BatchLoader:
    """`build()` on every process; if it fails on any (each one validates only its own share of the data),
    all of them stop with an error, rather than the others waiting for the failed one in a collective."""
    try:
        loader, error = build(), None
    except DataError as e:
        loader, error = None, e
    failed = [index for index, flag in enumerate(distributed.process_flags(error is not None)) if flag]
    if error is not None:
        raise error
    if failed:
        raise DataError("training data", f"process {failed[0]} could not read its share of the data (its log "
                                         "says why)")
    return loader


def _check_drafter_config(path: epath.Path, drafter_config) -> None:
    """A resumed run must have the drafter the workdir was started with (design §12.5). Every process checks,
    so all of them stop on a mismatch."""
    if path.exists():
        saved = json.loads(path.read_text())
        fields = json.loads(json.dumps(dataclasses.asdict(drafter_config)))
        changed = {key: (saved.get(key), value) for key, value in fields.items() if saved.get(key) != value}
        if changed:
            raise ConfigError(f"{path} records a different drafter than this config gives ((saved, now): "
                              f"{changed}); use a new workdir or the original config")


def _write_drafter_config(path: epath.Path, drafter_config) -> None:
    """Saved for export/eval, atomically, so that no other process can read a half-written file."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(dataclasses.asdict(drafter_config), indent=2, sort_keys=True) + "\n")
    partial.replace(path)


def _log_record(step: int, pending: list[dict[str, jax.Array]], interval_start: float, interval_steps: int,
                tokens_per_step: int, step_flops: float, peak_tflops: float | None, num_devices: int
                ) -> dict[str, Any]:
    """Mean loss/grad norm and pooled slot accuracies over the steps since the last log line (design §6)."""
    host = jax.device_get(pending)
    elapsed = time.perf_counter() - interval_start
    step_time = elapsed / interval_steps if interval_steps else None
    record = {
        "step": step,
        "loss": float(np.mean([m["loss"] for m in host])),
        **acceptance_metrics(np.sum([m["slot_correct"] for m in host], axis=0),
                             np.sum([m["slot_count"] for m in host], axis=0)),
        "anchor_utilisation": float(np.mean([m["anchor_utilisation"] for m in host])),
        "grad_norm": float(np.mean([m["grad_norm"] for m in host])),
        "learning_rate": float(host[-1]["learning_rate"]),
        "step_time": step_time,
        "tokens_per_second": tokens_per_step / step_time if step_time else None,
        "mfu": (step_flops / step_time / (peak_tflops * 1e12 * num_devices)
                if step_time and peak_tflops else None),
    }
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
