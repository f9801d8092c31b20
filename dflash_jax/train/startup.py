"""The start of a training run, before its first step: the mesh and the config settled, the step planned, the
target and the drafter's state loaded, the data loader and the step built (design §7, §13). `train/loop.py`
runs the steps of the `TrainingRun` built here.

This module reaches one floor up (design §17): a run plans its step, and may choose its mesh, before it starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict, FrozenConfigDict
from transformers import AutoTokenizer

from dflash_jax.data import BatchLoader, Prefetcher
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.planning import compare as plan_compare, plan
from dflash_jax.planning.chips import chip_of_kind
from dflash_jax.runtime import distributed
from dflash_jax.runtime.errors import ConfigError, DataError
from dflash_jax.runtime.workdir import append_config_history, drop_metrics_after
from dflash_jax.sharding import BATCH_AXES, auto_target_layout, state_shardings
from dflash_jax.train import epochs, flops, validate
from dflash_jax.train.checkpoint import Checkpointer
from dflash_jax.train.config import anchor_grid
from dflash_jax.train.state import StateSpec, TrainState, init_train_state, state_spec
from dflash_jax.train.step import StepFunctions, make_step, process_rows, schedule_length
from dflash_jax.weights.drafter_files import DRAFTER_CONFIG_FILE
from dflash_jax.weights.hub import pretrained_dir
from dflash_jax.weights.targets import load_target

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settled:
    """What a start decides before any weight is read (`settle`): the run's config with every derived field
    filled in, read-only from here, and what settling it built."""

    config: FrozenConfigDict  # mesh, batch size, target layout, mask token, total steps: all settled
    mesh: Mesh
    plan: plan.Plan | None  # where there was a memory budget: its executable is the run's step
    rows: list[int]  # this process's rows of every batch
    loader: BatchLoader  # the corpus indexed, not yet positioned (a resume positions it: `setup`)


@dataclasses.dataclass
class TrainingRun:
    """Everything the steps of a run need, built by `setup`."""

    config: FrozenConfigDict  # Settled.config
    workdir: epath.Path
    main: bool  # of several processes (runtime/distributed.py), the one that writes the run files
    mesh: Mesh
    rows: list[int]  # this process's rows of every batch
    spec: StateSpec
    state: TrainState  # restored from the newest checkpoint, else freshly initialised
    start_step: int
    checkpointer: Checkpointer
    batches: Prefetcher
    target: nnx.Module  # the frozen target, for the evaluation hook
    target_state: nnx.State  # its arrays, the step's separate argument
    step_fns: StepFunctions
    total_steps: jax.Array  # config.total_steps as the step's schedule-length argument
    predicted: tuple[float, float] | None  # the roofline's (perfect overlap, no overlap) step time, if planned
    step_flops: float
    peak_tflops: float | None
    first_slot: int  # the first drafted slot (design §18)


def settle(config: ConfigDict, workdir: epath.Path) -> Settled:
    """The run's config settled in one place, in order: the mask token (from the tokenizer, read once), the mesh
    (chosen where left at its defaults on accelerators), the batch size, the target layout (the plan's), the rows
    this process reads and the schedule's length (config.epochs: from the corpus). `config` is the run's own copy
    (validate.run_config); it is filled in here and frozen."""
    budget = config.hbm_gib or plan.device_memory_gib(jax.local_devices()[0])
    report = None
    target_config = plan.target_architecture(config)  # config.json alone: no weights are read here
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir(config.tokenizer_dir or config.target_dir))
    # The mask token is a constant of the compiled step: settled now, so that the step the plan compiles is the
    # run's own, which the loop then calls (one compile a start: design §13.1).
    config.drafter.mask_token_id = validate.resolve_mask_token_id(config, tokenizer, target_config.vocab_size)
    chip = chip_of_kind(jax.devices()[0].device_kind)  # the published peaks a predicted step time needs
    if budget and chip and jax.device_count() > 1 and plan_compare.chooses_mesh(config):
        # A mesh left at its defaults on accelerators: the candidates predicted without compiling, the best
        # compiled (design §13.1), so that a start or a resume compiles one step.
        chosen, report, choice = plan_compare.choose_mesh(config, target_config, jax.devices(), budget, chip)
        config.mesh.update(chosen.mesh)
        log.info("config.mesh left at its defaults: %s", choice)
    mesh = validate.mesh_from_config(config)
    batch_shards = int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))
    validate.settle_batch_size(config, batch_shards)

    # The step compiled from abstract arrays first (dflash_jax/planning/plan.py), where there is a budget to hold
    # it to: a run that cannot fit stops before any weight is read.
    if budget:
        report = report or plan.plan_train_step(config, target_config, mesh, budget)
        log.info("plan:\n%s", plan.format_plan(report))
        plan.check_budget(report)
        config.target_layout = report.target_layout  # "auto" settled by the plan
    elif config.target_layout == "auto":  # as when the devices report no memory (sharding.auto_target_layout)
        config.target_layout = auto_target_layout({}, None)

    # This process's rows of every batch, each row's share of the corpus indexed (data/loader.py). The
    # schedule's length is an argument of the step, not a constant of its program: counting the corpus for
    # config.epochs changes nothing the plan compiled.
    rows = process_rows(mesh, config.data.batch_size)
    loader = _agreed(lambda: BatchLoader(
        config.data.train_files, tokenizer, seq_len=config.data.seq_len, anchor_stride=anchor_grid(config).stride,
        batch_size=config.data.batch_size, rows=rows, seed=config.data.shuffle_seed,
        pad_id=tokenizer.pad_token_id or 0, max_positions=target_config.max_position_embeddings,
        bad_records=config.data.bad_records, chat_template_kwargs=config.data.chat_template_kwargs))
    config.total_steps = epochs.total_steps(config, workdir, loader, jax.process_index() == 0)
    return Settled(FrozenConfigDict(config.to_dict()), mesh, report, rows, loader)


def load_config_target(config: ConfigDict, mesh: Mesh, target_layout: str, attention_impl: str = "xla"):
    """(model, config) of config.target_dir as `train`, `evaluate` and `regenerate` load it: weights in
    config.target_dtype laid out by `target_layout`, its full-sequence attention on `attention_impl`, and its
    Gated DeltaNet products in config.target_matmul_dtype, so that the training teacher, evaluation and
    regeneration of one config compute the same greedy tokens (design §8.3)."""
    return load_target(config.target_dir, param_dtype=validate.dtype_of(config.target_dtype), mesh=mesh,
                       attention_impl=attention_impl, target_layout=target_layout,
                       delta_rule_dtype=config.target_matmul_dtype)


def setup(given: ConfigDict, settled: Settled, workdir: epath.Path) -> TrainingRun:
    """The run's pieces, from what `settle` decided; `given` is the config as the user gave it, for the workdir's
    history. A refused start (a resume that does not fit the workdir) writes no run files."""
    config, mesh = settled.config, settled.mesh
    main = jax.process_index() == 0
    # The frozen target; the drafter's architecture follows from it and the config (its mask token settled).
    # One attention backend for both models' full-sequence attention.
    attention_impl = resolve_attention_impl(config.attention_impl)
    log.info("loading target %s onto mesh %s (layout: %s, attention: %s)", config.target_dir, dict(mesh.shape),
             config.target_layout, attention_impl)
    target, target_config = load_config_target(config, mesh, config.target_layout, attention_impl)
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer=None)
    _check_drafter_config(workdir / DRAFTER_CONFIG_FILE, drafter_config)
    log.info("drafter: %s (attention: %s)", drafter_config, attention_impl)

    # Train state: restored from the newest checkpoint, else freshly initialised; the loader continues where
    # the checkpoint's data position says.
    spec = state_spec(drafter_config, config, attention_impl, mesh)
    checkpointer = Checkpointer(workdir, config.keep_checkpoints)
    restored = checkpointer.restore_latest(spec.abstract)  # the newest readable one (checkpoint.py)
    if restored is None:
        state, start_step = init_train_state(drafter_config, config, attention_impl, spec), 0
    else:
        start_step, state, data_state = restored
        settled.loader.restore(data_state)
        log.info("resuming from %s at step %d", workdir / "checkpoints", start_step)
    if main:  # the start is accepted: record it, and forget the metrics of steps the resume repeats
        _write_drafter_config(workdir / DRAFTER_CONFIG_FILE, drafter_config)
        append_config_history(workdir, given, start_step)
        drop_metrics_after(workdir, start_step)
    batches = Prefetcher(settled.loader)  # batches built in a background thread (data/prefetch.py)

    target_graphdef, target_state = nnx.split(target)
    target_shardings = state_shardings(target_state, mesh, config.target_layout)
    step_fns = make_step(config, drafter_config, spec, target_graphdef, target_shardings, mesh)
    report = settled.plan
    if report is not None and report.executable is not None:
        step_fns = step_fns._replace(train_step=report.executable)  # the plan's compile is the run's
    predicted = report.roofline.step_seconds if report is not None and report.roofline is not None else None
    return TrainingRun(config=config, workdir=workdir, main=main, mesh=mesh, rows=settled.rows, spec=spec,
                       state=state, start_step=start_step, checkpointer=checkpointer, batches=batches,
                       target=target, target_state=target_state, step_fns=step_fns,
                       total_steps=schedule_length(config.total_steps, mesh), predicted=predicted,
                       step_flops=flops.train_step_flops(config, target_config, drafter_config),
                       peak_tflops=flops.peak_tflops(config, jax.devices()[0]),
                       first_slot=drafter_config.drafter_method.first_slot)


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


def _check_drafter_config(path: epath.Path, drafter_config: DrafterConfig) -> None:
    """A resumed run must have the drafter the workdir was started with (design §12.5). Every process checks,
    so all of them stop on a mismatch."""
    if path.exists():
        # A field the file lacks (one added later, such as `method`) has its default.
        saved = {field.name: field.default for field in dataclasses.fields(drafter_config)
                 if field.default is not dataclasses.MISSING} | json.loads(path.read_text())
        fields = json.loads(json.dumps(dataclasses.asdict(drafter_config)))
        changed = {key: (saved.get(key), value) for key, value in fields.items() if saved.get(key) != value}
        if changed:
            raise ConfigError(f"{path} records a different drafter than this config gives ((saved, now): "
                              f"{changed}); use a new workdir or the original config")


def _write_drafter_config(path: epath.Path, drafter_config: DrafterConfig) -> None:
    """Saved for export/eval, atomically, so that no other process can read a half-written file."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(dataclasses.asdict(drafter_config), indent=2, sort_keys=True) + "\n")
    partial.replace(path)
