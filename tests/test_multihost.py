"""Training on several JAX processes: `python -m dflash_jax.train` launched as two CPU processes of two devices
each, joined over localhost by jax.distributed (config.distributed="auto" and the JAX_* variables), trains
exactly like one process on the same four-device mesh: same per-step losses, same checkpoint. Evaluation
during training runs too. Process 0 alone writes metrics.jsonl and the log lines."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from dflash_jax.errors import ConfigError
from dflash_jax.train import distributed
from dflash_jax.train.loop import train
from tests.train_fixtures import fast_cpu_compiles, losses, make_target, restore_last, tiny_config, write_corpus

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
# The same run for both launches. Two micro-batches of four rows, one row per device each, and feature noise:
# the rows each process feeds and the RNG must both line up with the single-process run.
SETTINGS = {"compute_dtype": "float32", "data.seq_len": 64, "data.anchor_stride": 8, "drafter.block_size": 8,
            "drafter.sliding_window": 24, "loss.row_chunk": 24, "loss.vocab_chunk": 200, "data.batch_size": 8,
            "grad_accum_steps": 2, "loss.noise_std": 0.1, "total_steps": STEPS, "log_every": 1, "checkpoint_every": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch_two_processes(target_dir: Path, train_file: Path, workdir: Path) -> list[str]:
    """Runs the train CLI (with evaluation) as processes 0 and 1 of one run; returns their outputs."""
    command = [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
               "--workdir", str(workdir), f"--config.target_dir={target_dir}", f"--config.data.train_files={train_file}",
               *(f"--config.{key}={value}" for key, value in SETTINGS.items()),
               # Exact τ at the last step too: its forward runs on the mesh of both processes.
               f"--config.data.eval_files={train_file}", f"--config.eval_every={STEPS}", "--config.eval_prompts=2"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",  # CPU collectives across processes
               JAX_DISABLE_MOST_OPTIMIZATIONS="1", PYTHONPATH=str(REPO),
               JAX_COORDINATOR_ADDRESS=f"localhost:{free_port()}", JAX_NUM_PROCESSES="2")
    processes = [subprocess.Popen(command, cwd=REPO, env=dict(env, JAX_PROCESS_ID=str(index)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for index in (0, 1)]
    try:
        outputs = [process.communicate(timeout=300)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()  # no-op once exited; a hung peer must not outlive the test
    for index, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"process {index}:\n{output[-3000:]}"
    return outputs


def test_two_processes_train_like_one_with_the_same_mesh(tmp_path):
    target_dir = make_target(tmp_path / "target")
    train_file = write_corpus(tmp_path / "train.jsonl")
    outputs = launch_two_processes(target_dir, train_file, tmp_path / "two")
    config = tiny_config(target_dir, train_file, **SETTINGS, **{"mesh.fsdp": 4})  # 4 of the session's 8 devices
    with fast_cpu_compiles():
        train(config, tmp_path / "one")

    assert "process 0 of 2: 2 local of 4 devices" in outputs[0]
    assert "process 1 of 2: 2 local of 4 devices" in outputs[1]
    assert f"step {STEPS}: loss" in outputs[0] and "step 1: loss" not in outputs[1]
    assert f"eval at step {STEPS}" in outputs[0] and "eval at" not in outputs[1]
    assert '"eval/tau"' in (tmp_path / "two" / "metrics.jsonl").read_text()
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == list(range(1, STEPS + 1))  # one record per step: only process 0 wrote
    np.testing.assert_allclose([two[step] for step in sorted(two)], [one[step] for step in sorted(one)], rtol=1e-5)

    # The checkpoint both processes wrote together holds the same state and data position. The collectives
    # sum in another order than one process does, and Adam's update m/sqrt(v) turns that rounding into up to
    # a few percent of one step (lr 6e-4) on weights whose gradient is nearly zero: hence atol 1e-4.
    one_step, one_state, one_data = restore_last(tmp_path / "one", config)
    two_step, two_state, two_data = restore_last(tmp_path / "two", config)
    assert one_step == two_step == STEPS
    assert two_data == one_data
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), two_state, one_state)


def test_auto_stays_single_process_without_a_coordinator(monkeypatch):
    monkeypatch.delenv(distributed.COORDINATOR_ENV, raising=False)
    distributed.initialize("auto")  # a no-op; jax.distributed.initialize would raise for want of a coordinator
    distributed.initialize("off")
    with pytest.raises(ConfigError, match=r"config.distributed must be one of \('auto', 'on', 'off'\), got 'yes'"):
        distributed.initialize("yes")
