"""bench/gpu_step.py (what bench/gpu.sh runs on an NVIDIA host) end to end on CPU with --tiny: it builds the
random target and the drafter on the host's devices, times the whole step, and its figures follow from its
own measurements and the project's FLOP count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench.gpu_step import TINY_TARGET, step_config
from dflash_jax.train import flops, validate
from tests.command import REPO


@pytest.mark.slow  # the benchmark script end to end in a subprocess: about 30 s
def test_gpu_step_benchmark_runs_tiny_on_two_cpu_devices(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", OUT=str(tmp_path / "out"))
    result = subprocess.run([sys.executable, "-m", "bench.gpu_step", "--tiny", "--steps", "2", "--warmup", "1",
                             "--peak-tflops", "1.0", "--chip", "H200"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "out" / "gpu_step.json").read_text())
    assert figures["mesh"] == {"data": 1, "fsdp": 2, "context": 1, "tensor": 1} and figures["attention_impl"] == "xla"
    assert len(figures["step_s_all"]) == 2 and figures["step_s"] == pytest.approx(np.median(figures["step_s_all"]))
    config = step_config(tiny=True, remat="none", peak_tflops=1.0)
    assert figures["tokens_per_s"] == pytest.approx(config.data.batch_size * config.data.seq_len / figures["step_s"])
    step_flops = flops.train_step_flops(config, TINY_TARGET,
                                        validate.resolve_drafter_config(config, TINY_TARGET, tokenizer=None))
    assert figures["model_tflops_per_step"] == pytest.approx(step_flops / 1e12)
    assert figures["mfu"] == pytest.approx(step_flops / (2 * 1e12 * figures["step_s"]))
    assert np.isfinite(figures["loss"]) and figures["loss"] > 0
    # The roofline of the same compiled step with H200's peaks: at least its slowest resource, at most their sum.
    seconds = figures["predicted_seconds"]
    assert figures["predicted_step_s"] == pytest.approx([max(seconds.values()), sum(seconds.values())])
    assert figures["predicted_bound"] == max(seconds, key=seconds.get) and seconds["compute"] > 0
    assert set(seconds) == {"compute", "hbm", "nvlink", "network"} and seconds["network"] == 0  # one host
    assert "| step time | predicted (roofline) | tokens/s |" in (tmp_path / "out" / "gpu_step.md").read_text()
