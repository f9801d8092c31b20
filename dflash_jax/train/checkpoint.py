"""Orbax checkpoints of a run, and the stop request that SIGTERM/SIGINT turn into a clean save-and-exit (design §7).

A checkpoint at step s holds the `TrainState` after s updates (drafter params, optimizer state, step, RNG)
and the data loader's position (JSON) of the next batch: everything needed to continue exactly as if the
run had never stopped. The frozen target is never saved; it is reloaded from its own directory.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import orbax.checkpoint as ocp

from dflash_jax.train.state import TrainState
from dflash_jax.weights.drafter_files import CHECKPOINTS_DIR, workdir_path

log = logging.getLogger(__name__)


class Checkpointer:
    """<workdir>/checkpoints/<step>/{state, data}; keeps the newest `keep` checkpoints."""

    def __init__(self, workdir: str | os.PathLike, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(workdir_path(workdir) / CHECKPOINTS_DIR, options=options,
                                              item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, data_state: dict[str, Any]) -> None:
        """Starts writing in the background (arrays are copied off the device first, so the caller may
        donate or overwrite `state` right away); `wait` or `close` blocks until it is on disk."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         data=ocp.args.JsonSave(data_state)), force=True)

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """The state (placed on the shardings carried by `abstract_state`) and the data position at `step`."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored.state, restored.data

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


class StopRequest:
    """While active, SIGTERM (preemption) and SIGINT (Ctrl-C) only set `requested`; the train loop checks it
    at each step boundary, saves a checkpoint and returns. A second SIGINT interrupts as usual."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = name
        log.warning("%s received: saving a checkpoint and stopping after the current step", name)
