"""The `dflash-jax` console script run as a user runs it, in a subprocess: a command's absl flags belong to
its process, so two commands cannot share the test process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("dflash-jax")  # installed by `pip install -e .` ([project.scripts])


def dflash_jax(*args: str, devices: int = 1, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`dflash-jax *args` from the repository root on `devices` CPU devices; stdout and stderr as text."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_DISABLE_MOST_OPTIMIZATIONS="1")  # small models: compile time dominates
    return subprocess.run([str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def user_error(result: subprocess.CompletedProcess) -> str:
    """The one-line message of a command that stopped on a user error (exit code 2, no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-3000:]
    return last
