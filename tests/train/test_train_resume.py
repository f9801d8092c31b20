"""Exact resume through the real train loop: a run stopped at step 10 and rerun matches a straight run, and a
SIGTERM sent to `python -m dflash_jax.train` leaves a checkpoint that the rerun continues from, with exit code
75 (stopped, rerun to resume); meanwhile a second trainer on the same workdir is refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dflash_jax.train.checkpoint import Checkpointer
from dflash_jax.train.loop import train
from tests.command import user_error
from tests.train_fixtures import (losses, make_qwen3_5_moe_target, make_target, restore_last, tiny_config,
                                  write_corpus)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_resume")
    return make_target(root / "target"), write_corpus(root / "train.jsonl")


# The Qwen3.5-MoE target (experts, shared expert, Gated DeltaNet) in make test-slow.
@pytest.mark.parametrize("optimizer, target", [
    ("adamw", "qwen3"), pytest.param("muon", "qwen3", marks=pytest.mark.slow),
    pytest.param("adamw", "qwen3_5_moe", marks=pytest.mark.slow)])
def test_stop_at_step_10_and_rerun_matches_a_straight_run(files, tmp_path, optimizer, target):
    target_dir, corpus = files
    moe = {}
    if target == "qwen3_5_moe":  # its drafter gives its own MLP width: the target has none to copy
        target_dir, moe = make_qwen3_5_moe_target(tmp_path / "target"), {"drafter.intermediate_size": 96}
    config = tiny_config(target_dir, corpus, total_steps=20, log_every=1, checkpoint_every=100, eval_every=10,
                         **{"loss.noise_std": 0.1, "optim.name": optimizer, **moe})

    def preempt_once(step, drafter, target):
        """Stands in for the scheduler: SIGTERM to ourselves after step 10 (handled by the loop's flag)."""
        if step == 10 and not preempted:
            preempted.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    preempted: list[int] = []
    train(config, tmp_path / "straight", evaluate=lambda step, drafter, target: {})
    first = train(config, tmp_path / "resumed", evaluate=preempt_once)
    second = train(config, tmp_path / "resumed", evaluate=preempt_once)

    assert (first["final_step"], first["stopped_by"]) == (10, "SIGTERM")
    assert (second["start_step"], second["final_step"], second["stopped_by"]) == (10, 20, None)
    straight_losses, resumed_losses = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed_losses) == list(range(1, 21))
    for step in range(1, 21):
        np.testing.assert_allclose(resumed_losses[step], straight_losses[step], rtol=1e-6, err_msg=f"step {step}")

    # Same final weights, optimizer state, RNG and data position.
    straight_step, straight_state, straight_data = restore_last(tmp_path / "straight", config)
    resumed_step, resumed_state, resumed_data = restore_last(tmp_path / "resumed", config)
    assert straight_step == resumed_step == 20
    assert resumed_data == straight_data
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), resumed_state, straight_state)


# slow: three train commands one after another (make test's budget)
@pytest.mark.slow
def test_a_second_trainer_is_refused_and_sigterm_exits_75_after_the_checkpoint_and_the_rerun_resumes(
        files, tmp_path):
    target_dir, train_file = files
    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
               "--workdir", str(workdir), f"--config.target_dir={target_dir}", f"--config.data.train_files={train_file}",
               "--config.data.seq_len=64", "--config.drafter.block_size=8", "--config.drafter.sliding_window=24",
               "--config.log_every=1", "--config.checkpoint_every=1000", "--config.mesh.fsdp=1"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               PYTHONPATH=str(REPO))
    process = subprocess.Popen(command + ["--config.total_steps=100000"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no step was logged in time"
        time.sleep(0.5)
    second = subprocess.run(command + ["--config.total_steps=100000"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert user_error(second).startswith(
        f"error: {workdir}: another trainer is running in this workdir (host {socket.gethostname()}, "
        f"pid {process.pid}, started ")
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 75, output[-3000:]  # EX_TEMPFAIL: stopped, rerun to resume
    assert "SIGTERM received" in output

    stopped_at = Checkpointer(workdir, keep=1).latest_step()
    logged = losses(workdir)
    assert stopped_at is not None and stopped_at >= max(logged)  # every logged step is in the checkpoint

    rerun = subprocess.run(command + [f"--config.total_steps={stopped_at + 2}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {workdir / 'checkpoints'} at step {stopped_at}" in rerun.stderr
    assert sorted(losses(workdir))[-2:] == [stopped_at + 1, stopped_at + 2]
