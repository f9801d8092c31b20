"""Orbax checkpoints of a run (design §7); the stop request that SIGTERM/SIGINT turn into a clean save-and-exit is
runtime/stop.py.

A checkpoint at step s holds the `TrainState` after s updates (drafter params, optimizer state, step, RNG)
and the data loader's position (JSON) of the next batch: everything needed to continue exactly as if the
run had never stopped. The frozen target is never saved; it is reloaded from its own directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental.multihost_utils import sync_global_devices

from dflash_jax.runtime import storage
from dflash_jax.runtime.paths import is_url
from dflash_jax.train.state import TrainState
from dflash_jax.runtime.workdir import newest_readable
from dflash_jax.weights.drafter_files import CHECKPOINTS_DIR, workdir_path

log = logging.getLogger(__name__)

UNREADABLE_DIR = "checkpoints.unreadable"  # unreadable checkpoints a resume fell back past


class Checkpointer:
    """<workdir>/checkpoints/<step>/{state, data}; keeps the newest `keep` checkpoints."""

    def __init__(self, workdir: str | os.PathLike, keep: int):
        self._workdir = workdir_path(workdir)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
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
