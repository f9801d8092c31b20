"""Several JAX processes (multi-host pods, GPU clusters): joining them up before anything touches a device.

A multi-process run is the same command on every host. After `initialize`, `jax.devices()` lists every
device of every process and the mesh spans them all; each process reads, tokenizes and packs only the batch
rows its own devices hold (`train.step.process_rows`, design §16), process 0 alone writes the run files
and log lines, and every process takes part in Orbax checkpointing (which coordinates the hosts itself; the
workdir must be on storage all hosts share, e.g. a GCS bucket or NFS). The processes agree before acting
where one of them alone could decide: a stop request (`StopVote`), a data error at start-up
(`process_flags`); `gather_json` joins their data positions into the checkpoint's.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.runtime.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
# Set by whoever launches the processes (GPU clusters, or several processes by hand): process 0's host:port.
# JAX reads it itself; the process count and this process's id come from the two variables after it.
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def initialize(mode: str) -> None:
    """Joins this process to the others of its run (`jax.distributed.initialize`); call before any other
    JAX call, since the device list is fixed when the first one initialises the backend.

    mode "auto": when JAX_COORDINATOR_ADDRESS is set (with JAX_NUM_PROCESSES and JAX_PROCESS_ID); "on":
    always, with whatever of those variables is set and JAX detecting the rest from the cluster (Cloud TPU
    pod slices, Slurm, Open MPI); "off": never, a single process.
    """
    if mode not in MODES:
        raise ConfigError(f"config.distributed must be one of {MODES}, got {mode!r}")
    if mode == "off" or (mode == "auto" and COORDINATOR_ENV not in os.environ):
        return
    try:
        jax.distributed.initialize(num_processes=_env_int(NUM_PROCESSES_ENV), process_id=_env_int(PROCESS_ID_ENV))
    except ValueError as error:  # JAX found no cluster to take the missing values from
        raise ConfigError(f"config.distributed={mode!r}: jax.distributed.initialize failed ({error}); set "
                          f"{COORDINATOR_ENV}, {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV}, or run on a cluster JAX "
                          f"detects (Cloud TPU pod, Slurm, Open MPI)") from None
    log.info("process %d of %d: %d local of %d devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer") from None


def process_flags(flag: bool) -> list[bool]:
    """Every process's `flag`, in process order, on every process (a collective: all processes call it)."""
    if jax.process_count() == 1:
        return [flag]
    return [bool(value) for value in multihost_utils.process_allgather(np.int32(flag))]


def gather_json(value: Any) -> list[Any]:
    """Every process's JSON-serialisable `value`, in process order, on every process (a collective)."""
    if jax.process_count() == 1:
        return [value]
    encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.int32(len(encoded)))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(encoded)] = encoded
    gathered = multihost_utils.process_allgather(padded)
    return [json.loads(row[:length].tobytes()) for row, length in zip(gathered, lengths)]


class StopVote:
    """The stop decision all processes take at the same step boundary, so that none of them enters the
    collective checkpoint save while another dispatches the next step (each process gets its own SIGTERM,
    at its own moment, or only one of them does).

    Call it at every step boundary with whether this process was asked to stop; it returns whether to stop
    here. One process: its own flag. Several: the flags of boundary k are reduced on the devices behind step
    k and read at boundary k+1, so the vote never leaves the devices idle waiting for the host; every
    process reads the same reduction, so all stop after the same step (one step after the first request).
    """

    def __init__(self):
        self._pending: jax.Array | None = None
        if jax.process_count() > 1:
            mesh = Mesh(np.asarray(jax.devices()), ("devices",))
            self._flags = NamedSharding(mesh, PartitionSpec("devices"))
            self._any = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def __call__(self, requested: bool) -> bool:
        if jax.process_count() == 1:
            return requested
        flags = jax.make_array_from_callback(
            (jax.device_count(),), self._flags,
            lambda index: np.full(len(range(jax.device_count())[index[0]]), requested, np.int32))
        previous, self._pending = self._pending, self._any(flags)
        return previous is not None and bool(previous.addressable_data(0))
