"""Orbax checkpoints of a run (design §7), written and read by `Checkpointer` alone: the trainer's saves and
resumes, and the drafter that export, evaluation and learning-parity read from a workdir (`restore_drafter`).
The stop request that SIGTERM/SIGINT turn into a clean save-and-exit is runtime/stop.py.

A checkpoint at step s holds the `TrainState` after s updates (drafter params, optimizer state, step, RNG)
and the data loader's position (JSON) of the next batch: everything needed to continue exactly as if the
run had never stopped. The frozen target is never saved; it is reloaded from its own directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental.multihost_utils import sync_global_devices
from jax.sharding import SingleDeviceSharding

from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.runtime import storage
from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.runtime.paths import as_path, is_url
from dflash_jax.runtime.workdir import library_logs_captured, newest_readable
from dflash_jax.train.state import TrainState
from dflash_jax.weights.drafter_files import CHECKPOINTS_DIR, DRAFTER_CONFIG_FILE, load_drafter_dir

log = logging.getLogger(__name__)

UNREADABLE_DIR = "checkpoints.unreadable"  # unreadable checkpoints a resume fell back past


class Checkpointer:
    """<workdir>/checkpoints/<step>/{state, data}; keeps the newest `keep` checkpoints."""

    def __init__(self, workdir: str | os.PathLike, keep: int | None, *, read_only: bool = False):
        """keep: the newest checkpoints kept; read_only: a reader of a workdir's checkpoints, which saves none."""
        self._workdir = as_path(workdir)
        with library_logs_captured() if read_only else contextlib.nullcontext():
            # Orbax warns that a read-only manager saves nothing: that is the point
            options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only)
            self._manager = ocp.CheckpointManager(self._workdir / CHECKPOINTS_DIR, options=options,
                                                  item_names=("state", "data"))
        # The newest step known to be complete, and the save in flight: what a stop whose grace ran out names
        # (runtime/stop.py) without asking the storage, which may be the part that no longer answers.
        self._complete: int | None = None
        self._in_flight: int | None = None
        self._saving_bytes = 0  # of the save in flight, for its deadline

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore_latest(self, abstract_state: TrainState) -> tuple[int, TrainState, dict[str, Any]] | None:
        """(step, state, data position) of the newest readable checkpoint, None when there is none at all.

        Unreadable newer checkpoints (a truncated or missing file) are each reported in one warning line and
        moved to <workdir>/checkpoints.unreadable/, so that the resumed run can write those steps again;
        CheckpointError when no checkpoint is readable.
        """
        steps = self._manager.all_steps()
        if not steps:
            return None
        step, (state, data), unreadable = newest_readable(
            self._workdir / CHECKPOINTS_DIR, steps, lambda step: self.restore(step, abstract_state))
        if unreadable:
            if jax.process_index() == 0:
                for bad in unreadable:
                    _set_aside(self._workdir, bad)
            sync_global_devices("dflash_jax: unreadable checkpoints set aside")
            self._manager.reload()
        self._complete = step
        return step, state, data

    def restore_params(self, step: int | None, abstract_params: nnx.State) -> tuple[int, nnx.State]:
        """The drafter's parameters alone (not the optimizer state) at `step` (None: the newest readable one; an
        unreadable `step` is an error, not a fallback), onto the shardings `abstract_params` carries."""
        where = self._workdir / CHECKPOINTS_DIR
        steps = sorted(self._manager.all_steps())
        if not steps:
            raise CheckpointError(f"{where}: no checkpoint found")
        if step is not None and step not in steps:
            raise CheckpointError(f"{where}: no checkpoint at step {step}; available steps: "
                                  f"{', '.join(map(str, steps))}")
        # TrainState.params was saved as a pytree of nnx Variables: each array sits under a final "value" key.
        item = {"params": jax.tree.map(lambda leaf: {"value": leaf}, nnx.to_pure_dict(abstract_params))}
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
        step, restored, _ = newest_readable(where, steps if step is None else [step],
                                            lambda at: self._manager.restore(at, args=args))
        values = jax.tree.map(lambda variable: variable["value"], restored.state["params"],
                              is_leaf=lambda node: isinstance(node, dict) and set(node) == {"value"})
        nnx.replace_by_pure_dict(abstract_params, values)
        return step, abstract_params

    def save(self, step: int, state: TrainState, data_state: dict[str, Any]) -> None:
        """Starts writing in the background (arrays are copied off the device first, so the caller may
        donate or overwrite `state` right away); `wait` or `close` blocks until it is on disk."""
        with self._bounded("checkpoint save", self._saving_bytes):  # it first waits for the previous save
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             data=ocp.args.JsonSave(data_state)), force=True)
        self._finished()
        self._in_flight, self._saving_bytes = step, _own_bytes(state)

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """The state (placed on the shardings carried by `abstract_state`) and the data position at `step`."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored.state, restored.data

    def wait(self) -> None:
        with self._bounded("checkpoint save", self._saving_bytes):
            self._manager.wait_until_finished()
        self._finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def resume_point(self) -> str:
        """Where a rerun resumes, in words, from what this process knows (no storage call)."""
        where = os.fspath(self._workdir / CHECKPOINTS_DIR)
        # A save cut off mid-flight may still complete: its last requests can already sit in the store's queue
        # (a stalled bucket answers them later), and a checkpoint is complete once its commit marker lands.
        later = "" if self._in_flight is None else f", or from step {self._in_flight} if that save in flight completes"
        if self._complete is None:
            return f"no checkpoint in {where} is complete: a rerun starts from step 0{later}"
        return f"the last complete checkpoint is step {self._complete} in {where}: a rerun resumes from it{later}"

    def _finished(self) -> None:
        """The save in flight has finished (the manager waited for it)."""
        if self._in_flight is not None:
            self._complete, self._in_flight = self._in_flight, None

    @contextlib.contextmanager
    def _bounded(self, operation: str, size: int) -> Iterator[None]:
        """A save into a bucket runs in TensorStore's threads, whose own retries of an unanswered request take a
        quarter of an hour: bounded by the storage watchdog instead, with time for this process's `size` bytes
        (design §7.2). What the save's background thread met reaches the caller wrapped by Orbax: an outage
        there is reported as one, not as a failed save."""
        where = os.fspath(self._workdir / CHECKPOINTS_DIR)
        with storage.deadline(operation, where, size) if is_url(self._workdir) else contextlib.nullcontext():
            try:
                yield
            except Exception as error:
                outage = storage.outage_in(error, operation, where)
                if outage is None or outage is error:
                    raise
                raise outage from error


def _own_bytes(state: TrainState) -> int:
    """The bytes this process writes of `state`: one copy of each of its shards."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)
               for shard in leaf.addressable_shards if shard.replica_id == 0)


def _set_aside(workdir: epath.Path, step: int) -> None:
    """Moves the unreadable checkpoint `step` out of the manager's sight, keeping its files for inspection."""
    aside = workdir / UNREADABLE_DIR
    aside.mkdir(parents=True, exist_ok=True)
    target = aside / str(step)
    if target.exists():  # set aside before, at an earlier resume
        target = aside / f"{step}.{time.strftime('%Y%m%d-%H%M%S')}"
    (workdir / CHECKPOINTS_DIR / str(step)).rename(target)
    log.warning("moved the unreadable checkpoint step %d to %s", step, target)


def restore_drafter(workdir: str | os.PathLike, step: int | None) -> tuple[Drafter, DrafterConfig, int]:
    """The fp32 drafter saved at `step` (None: the newest readable one) of a `dflash-jax train` workdir, on this
    process's CPU, and the step read."""
    workdir = as_path(workdir)
    config_path = workdir / DRAFTER_CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found; is {workdir} a training workdir?")
    config = DrafterConfig(**json.loads(config_path.read_text()))
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0))), nnx.Param, ...)
    cpu = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])  # this process's, of several
    params = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=cpu), params)
    step, params = Checkpointer(workdir, None, read_only=True).restore_params(step, params)
    return nnx.merge(graphdef, params, rest), config, step


def load_drafter(workdir: str | os.PathLike | None, drafter_dir: str | Path | None, step: int | None
                 ) -> tuple[Drafter, DrafterConfig, str]:
    """(fp32 drafter, its config, where it came from) from an export directory, else a workdir checkpoint."""
    if drafter_dir:
        drafter, drafter_config = load_drafter_dir(drafter_dir)
        return drafter, drafter_config, str(drafter_dir)
    drafter, drafter_config, step = restore_drafter(workdir, step)
    return drafter, drafter_config, f"{workdir} step {step}"
