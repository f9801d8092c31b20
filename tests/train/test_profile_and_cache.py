"""The train command's persistent compilation cache (on by default, in <workdir>/compilation_cache) and its
jax.profiler trace of the steps config.profile_steps names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_fixtures import make_target, write_corpus

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about a minute of CPU: `make test-slow`
def test_train_command_caches_compilations_and_traces_the_requested_steps(tmp_path):
    target_dir, train_file = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl")
    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
               "--workdir", str(workdir), f"--config.target_dir={target_dir}",
               f"--config.data.train_files={train_file}", "--config.data.seq_len=64", "--config.drafter.block_size=8",
               "--config.drafter.sliding_window=24", "--config.total_steps=4", "--config.mesh.fsdp=1",
               "--config.profile_steps=(2, 3)"]
    # Without JAX's own cache setting (the test session's), the command's default is <workdir>/compilation_cache.
    env = {key: value for key, value in os.environ.items() if key != "JAX_COMPILATION_CACHE_DIR"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=str(REPO))  # cache even quick compiles
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"profile of steps 2-3 written under {workdir / 'profile'}" in result.stderr
    assert list((workdir / "profile").rglob("*.xplane.pb"))
    assert any((workdir / "compilation_cache").iterdir())
