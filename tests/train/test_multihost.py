"""Training on several JAX processes: `python -m dflash_jax.train` launched as two CPU processes of four devices
each, joined over localhost by jax.distributed (config.distributed="auto" and the JAX_* variables).

- It trains exactly like one process on the same eight-device mesh (same per-step losses, same checkpoint),
  each process building only its own rows of every batch from its own share of the corpus; evaluation
  during training runs too; process 0 alone writes metrics.jsonl and the log lines.
- A SIGTERM sent to one process only stops both after the same step, with one checkpoint; one process of
  eight devices resumes it (another host count) and finishes exactly as an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dflash_jax.runtime.errors import ConfigError
from dflash_jax.runtime import distributed
from dflash_jax.train.loop import train
from tests.process_fixtures import REPO, cpu_env, outputs_of, start_two_processes
from tests.train_fixtures import losses, make_target, restore_last, tiny_config, write_corpus

STEPS = 16  # long enough for a stop to land before the end; the same in every run (LR schedule)
# The same run for every launch. Two micro-batches of eight rows, one row per device each, and feature noise:
# the rows each process feeds and the RNG must both line up with the single-process run.
SETTINGS = {"compute_dtype": "float32", "data.seq_len": 64, "data.anchor_stride": 8, "drafter.block_size": 8,
            "drafter.sliding_window": 24, "loss.row_chunk": 24, "loss.vocab_chunk": 200, "data.batch_size": 16,
            "grad_accum_steps": 2, "loss.noise_std": 0.1, "total_steps": STEPS, "log_every": 1,
            "checkpoint_every": 1000}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    return make_target(root / "target"), write_corpus(root / "train.jsonl")


@pytest.fixture(scope="module")
def straight(files, tmp_path_factory):
    """The reference both tests compare with: the run in this process on the session's eight devices, to the
    end, uninterrupted (checkpoint_every changes only when the state is saved, never the run)."""
    config = tiny_config(*files, **SETTINGS, **{"mesh.fsdp": 8})
    workdir = tmp_path_factory.mktemp("straight")
    train(config, workdir)
    return config, workdir


def train_command(target_dir: Path, train_file: Path, workdir: Path, *extra: str) -> list[str]:
    """The train command of SETTINGS; the session's compilation cache (JAX_COMPILATION_CACHE_DIR, which the
    command uses when its config names none) lets later launches of the same program (the second pair of
    processes, the one-process resume) skip XLA's compile."""
    return [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
            "--workdir", str(workdir), f"--config.target_dir={target_dir}", f"--config.data.train_files={train_file}",
            *(f"--config.{key}={value}" for key, value in SETTINGS.items()), *extra]


def assert_each_process_built_only_its_rows(outputs: list[str], records: int) -> None:
    """Process p holds rows [8p, 8p + 8) of each batch of 16 and indexed only their share of the corpus."""
    indexed = []
    for index, output in enumerate(outputs):
        rows = f"{8 * index}-{8 * index + 7}"
        found = re.search(rf"rows {rows} of each batch of 16: (\d+) records of ", output)
        assert found, f"process {index} did not report its rows {rows}:\n{output[-3000:]}"
        indexed.append(int(found.group(1)))
    assert sum(indexed) == records and max(indexed) < records  # each record indexed by exactly one process


@pytest.mark.slow  # two processes compiling at once on 2 cores: about 90 s
def test_two_processes_train_like_one_with_the_same_mesh(files, straight, tmp_path):
    target_dir, train_file = files
    # Exact τ at the last step too: its forward runs on the mesh of both processes; a checkpoint halfway.
    outputs = outputs_of(start_two_processes(train_command(
        target_dir, train_file, tmp_path / "two", f"--config.data.eval_files={train_file}",
        f"--config.eval_every={STEPS}", "--config.eval_prompts=2", "--config.eval_max_new_tokens=8",
        f"--config.checkpoint_every={STEPS // 2}")))
    config, one_workdir = straight

    assert "process 0 of 2: 4 local of 8 devices" in outputs[0]
    assert "process 1 of 2: 4 local of 8 devices" in outputs[1]
    assert_each_process_built_only_its_rows(outputs, records=200)
    assert f"step {STEPS}: loss" in outputs[0] and "step 1: loss" not in outputs[1]
    assert f"eval at step {STEPS}" in outputs[0] and "eval at" not in outputs[1]
    assert '"eval/tau"' in (tmp_path / "two" / "metrics.jsonl").read_text()
    one, two = losses(one_workdir), losses(tmp_path / "two")
    assert sorted(two) == list(range(1, STEPS + 1))  # one record per step: only process 0 wrote
    np.testing.assert_allclose([two[step] for step in sorted(two)], [one[step] for step in sorted(one)], rtol=1e-5)

    # The checkpoint both processes wrote together holds the same state and data position. The collectives
    # sum in another order than one process does, and Adam's update m/sqrt(v) turns that rounding into up to
    # a few percent of one step (lr 6e-4) on weights whose gradient is nearly zero: hence atol 1e-4.
    assert sorted(map(int, os.listdir(tmp_path / "two" / "checkpoints"))) == [STEPS // 2, STEPS]
    one_step, one_state, one_data = restore_last(one_workdir, config)
    two_step, two_state, two_data = restore_last(tmp_path / "two", config)
    assert one_step == two_step == STEPS
    assert two_data == one_data
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), two_state, one_state)


# slow: two processes compile and stop on 2 cores (make test's budget); the straight run stays in make test
@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step_and_one_checkpoint(files, straight, tmp_path):
    command = train_command(*files, tmp_path / "run")
    processes = start_two_processes(command)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert all(process.poll() is None for process in processes), outputs_of(processes)
        assert time.monotonic() < deadline, "no step was logged in time"
        time.sleep(0.05)
    processes[1].send_signal(signal.SIGTERM)  # process 0 is not told
    outputs = outputs_of(processes, returncode=os.EX_TEMPFAIL)  # 75 from both: stopped, rerun to resume

    stops = [re.search(r"stopped by (.+) at step (\d+); rerun", output) for output in outputs]
    assert all(stops), [output[-2000:] for output in outputs]
    assert stops[0].group(1) == "a stop on another process" and stops[1].group(1) == "SIGTERM"
    stopped_at = int(stops[0].group(2))
    assert int(stops[1].group(2)) == stopped_at < STEPS
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [str(stopped_at)]  # one checkpoint, both in it
    assert sorted(losses(tmp_path / "run")) == list(range(1, stopped_at + 1))

    # One process with all eight devices finishes the run from the two processes' checkpoint.
    resumed = subprocess.run(command, cwd=REPO, env=cpu_env(8), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path / 'run' / 'checkpoints'} at step {stopped_at}" in resumed.stderr
    assert "rows 0-15 of each batch of 16: 200 records" in resumed.stderr

    config, straight_workdir = straight
    run, straight_losses = losses(tmp_path / "run"), losses(straight_workdir)
    assert sorted(run) == sorted(straight_losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([run[step] for step in sorted(run)],
                               [straight_losses[step] for step in sorted(run)], rtol=1e-5)
    run_step, run_state, run_data = restore_last(tmp_path / "run", config)
    straight_step, straight_state, straight_data = restore_last(straight_workdir, config)
    assert run_step == straight_step == STEPS and run_data == straight_data
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), run_state, straight_state)


def test_auto_stays_single_process_without_a_coordinator(monkeypatch):
    monkeypatch.delenv(distributed.COORDINATOR_ENV, raising=False)
    distributed.initialize("auto")  # a no-op; jax.distributed.initialize would raise for want of a coordinator
    distributed.initialize("off")
    with pytest.raises(ConfigError, match=r"config.distributed must be one of \('auto', 'on', 'off'\), got 'yes'"):
        distributed.initialize("yes")
