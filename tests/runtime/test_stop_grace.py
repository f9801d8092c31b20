"""A stop's grace budget (runtime/stop.py, design §7.3), in a process of its own since its end is the point: after
SIGTERM, work that outlasts the budget ends the process with exit code 76 and one line naming where a rerun
resumes, at the budget's end; work that ends within it ends the budget, and the process lives on past it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from dflash_jax.runtime.stop import EXIT_STOP_GRACE_EXPIRED

REPO = Path(__file__).resolve().parents[2]
GRACE = 1.0
# SIGTERM to itself inside a stop with the budget, then `work` seconds of work, then 2 s more outside the stop.
SCRIPT = """
import os, signal, sys, time
from dflash_jax.runtime.stop import StopRequest
with StopRequest({grace}, lambda: "the last complete checkpoint is step 4 in gs://b/run/checkpoints") as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested == "SIGTERM"
    time.sleep({work})
time.sleep(2 * {grace})
print("lived on")
"""


def stopped(work: float) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(grace=GRACE, work=work)], cwd=REPO,
                            capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(REPO)})
    return result, time.monotonic() - start


def test_work_past_the_grace_budget_ends_the_process_with_76_and_the_resume_point():
    result, seconds = stopped(work=30.0)
    assert result.returncode == EXIT_STOP_GRACE_EXPIRED == 76, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: stop grace expired: the stop by SIGTERM at ")
    assert line.endswith("did not finish within 1 s (config.stop_grace_seconds); the last complete checkpoint is "
                         "step 4 in gs://b/run/checkpoints (exit code 76)")
    assert "lived on" not in result.stdout
    assert seconds < 30.0 / 2  # at the budget's end (plus the interpreter's start), not the work's


def test_work_within_the_grace_budget_ends_it():
    result, _ = stopped(work=0.1)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "lived on\n" and "stop grace expired" not in result.stderr
