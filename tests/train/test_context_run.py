"""A run with each row split over two devices (config.mesh.context = 2, design §19), through the command line as a
user runs it on 8 simulated devices: it trains, resumes from its checkpoint and evaluates."""

from __future__ import annotations

import json

import pytest

from tests.command import dflash_jax

CONTEXT_RUN = ("--config", "configs/toy.py", "--config.mesh.context=2", "--config.mesh.fsdp=-1",
               "--config.data.batch_size=4", "--config.checkpoint_every=2")


@pytest.mark.slow  # three commands on the toy target (about a minute and a half)
def test_a_toy_run_with_rows_over_two_devices_trains_resumes_and_evaluates(tmp_path):
    workdir = tmp_path / "run"
    first = dflash_jax("train", "--workdir", str(workdir), *CONTEXT_RUN, "--config.total_steps=2", devices=8)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = dflash_jax("train", "--workdir", str(workdir), *CONTEXT_RUN, "--config.total_steps=4", devices=8)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "at step 2" in resumed.stderr
    summary = json.loads(resumed.stderr.split("summary: ")[-1].splitlines()[0])
    assert (summary["start_step"], summary["final_step"]) == (2, 4)

    out = tmp_path / "eval.json"
    evaluated = dflash_jax("evaluate", "--workdir", str(workdir), *CONTEXT_RUN, "--config.eval_prompts=2",
                           "--max_new_tokens", "8", "--json", str(out), devices=8)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(out.read_text())["trained"]["tau"] >= 1.0
