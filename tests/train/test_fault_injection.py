"""Kills at random points: `python -m dflash_jax.train` with a checkpoint after every step is SIGKILLed a few
times (seeded, so the points are reproducible), most often while a checkpoint is being written, and rerun each
time. The final parameters, optimizer state and data position equal an uninterrupted run's, and metrics.jsonl
holds every step exactly once with the uninterrupted run's losses."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
import numpy as np

from tests.train_fixtures import losses, make_target, restore_last, tiny_config, write_corpus

REPO = Path(__file__).resolve().parents[2]
STEPS, KILLS, SEED = 12, 3, 0


def logged_steps(workdir: Path) -> int:
    """The highest step in metrics.jsonl (0 before the first), tolerating a line being written."""
    try:
        return max(losses(workdir), default=0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.slow  # about a minute of CPU: `make test-slow`
def test_random_kills_during_checkpoint_writes_end_like_an_uninterrupted_run(tmp_path):
    target_dir, train_file = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl")
    settings = {"data.seq_len": 64, "drafter.block_size": 8, "drafter.sliding_window": 24, "mesh.fsdp": 1,
                "target_dtype": "float32", "compute_dtype": "float32", "loss.noise_std": 0.1, "total_steps": STEPS,
                "log_every": 1, "checkpoint_every": 1, "keep_checkpoints": 2}

    def command(workdir: Path) -> list[str]:
        return [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
                "--workdir", str(workdir), f"--config.target_dir={target_dir}", f"--config.data.train_files={train_file}",
                *(f"--config.{key}={value}" for key, value in settings.items())]

    # One device, unoptimised compiles, and a compilation cache the reruns share: each start takes seconds.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "compile_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=str(REPO))
    straight = subprocess.run(command(tmp_path / "straight"), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=1800)
    assert straight.returncode == 0, straight.stderr[-3000:]

    rng = random.Random(SEED)
    workdir = tmp_path / "killed"
    kill_after = sorted(rng.sample(range(1, STEPS - 1), KILLS))  # steps after which a kill comes
    kills = in_write = 0
    for step in kill_after:
        process = subprocess.Popen(command(workdir), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 900
        while logged_steps(workdir) < step and process.poll() is None:
            assert time.monotonic() < deadline, f"step {step} was not reached in time"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # into the next step, or the checkpoint being written
        if process.poll() is None:
            process.kill()
            kills += 1
            # Orbax writes a checkpoint under a temporary name and renames it when complete.
            in_write += any(".orbax-checkpoint-tmp" in path.name for path in (workdir / "checkpoints").iterdir())
        process.wait()
    assert kills >= 2 and in_write >= 1, f"{kills} kills, {in_write} of them during a checkpoint write"
    final = subprocess.run(command(workdir), cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert final.returncode == 0, final.stderr[-3000:]

    assert losses(workdir) == losses(tmp_path / "straight")  # each step once, bit for bit
    assert sorted(losses(workdir)) == list(range(1, STEPS + 1))
    config = tiny_config(target_dir, train_file, **settings)
    straight_step, straight_state, straight_data = restore_last(tmp_path / "straight", config)
    killed_step, killed_state, killed_data = restore_last(workdir, config)
    assert killed_step == straight_step == STEPS and killed_data == straight_data
    jax.tree.map(np.testing.assert_array_equal, killed_state, straight_state)
