"""Several JAX processes (multi-host pods, GPU clusters): joining them up before anything touches a device.

A multi-process run is the same command on every host. After `initialize`, `jax.devices()` lists every
device of every process and the mesh spans them all; each process feeds only the batch rows its own devices
hold (`train.step.put_batch`), process 0 alone writes the run files and log lines, and every process takes
part in Orbax checkpointing (which coordinates the hosts itself; the workdir must be on storage all hosts
share, e.g. a GCS bucket or NFS).
"""

from __future__ import annotations

import logging
import os

import jax

from dflash_jax.errors import ConfigError

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
