"""Orbax checkpoints of a run, and the stop request that SIGTERM/SIGINT turn into a clean save-and-exit (design §7).

A checkpoint at step s holds the `TrainState` after s updates (drafter params, optimizer state, step, RNG)
and the data loader's position (JSON) of the next batch: everything needed to continue exactly as if the
run had never stopped. The frozen target is never saved; it is reloaded from its own directory.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import SingleDeviceSharding

from dflash_jax.errors import CheckpointError
from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.train.state import TrainState

log = logging.getLogger(__name__)

DRAFTER_CONFIG_FILE, CHECKPOINTS_DIR = "drafter_config.json", "checkpoints"


def workdir_path(workdir: str | os.PathLike) -> epath.Path:
    """A run directory as every reader and writer of it addresses it: an `epath.Path` (what Orbax uses), so
    that a bucket URI such as gs://bucket/run stays one (pathlib would turn it into the local path
    gs:/bucket/run); local paths are made absolute, as Orbax requires."""
    text = os.fspath(workdir)
    return epath.Path(text) if "://" in text else epath.Path(os.path.expanduser(text)).absolute()


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


def restore_drafter(workdir: str | os.PathLike, step: int | None) -> tuple[Drafter, DrafterConfig, int]:
    """The fp32 drafter saved at `step` (None: the latest) of a `python -m dflash_jax.train` workdir."""
    workdir = workdir_path(workdir)
    config_path = workdir / DRAFTER_CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found; is {workdir} a training workdir?")
    config = DrafterConfig(**json.loads(config_path.read_text()))
    manager = ocp.CheckpointManager(workdir / CHECKPOINTS_DIR, item_names=("state", "data"),
                                    options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointError(f"{workdir / CHECKPOINTS_DIR}: no checkpoint found")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{workdir / CHECKPOINTS_DIR}: no checkpoint at step {step}; available steps: "
                              f"{', '.join(map(str, steps))}")

    # Restore only TrainState.params (not the optimizer state) onto the host CPU. The state was saved as a
    # pytree of nnx Variables, whose leaves sit under a final "value" key.
    abstract = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    variables = [(tuple(map(str, path)), variable) for path, variable in nnx.to_flat_state(params)]
    target: dict = {}
    for path, variable in variables:
        _nested(target, path)["value"] = jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=cpu)
    item = {"params": target}
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
    for path, variable in variables:
        variable.set_value(_nested(restored.state["params"], path)["value"])
    return nnx.merge(graphdef, params, rest), config, step


def _nested(tree: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        tree = tree.setdefault(key, {})
    return tree
