"""The whole workflow against a mixture-of-experts target (qwen3_moe), as a user runs it: `dflash-jax train`,
`evaluate` (exact τ, and the speculative and DDTree decoders lossless against plain greedy) and `export`."""

from __future__ import annotations

import json

import pytest

from dflash_jax.weights.drafter_files import load_drafter_dir
from tests.command import dflash_jax
from tests.train_fixtures import make_qwen3_moe_target, write_corpus

TINY = "configs/tiny.py"


@pytest.mark.slow  # three commands through the console script, ~2 min
def test_train_evaluate_and_export_a_drafter_for_a_moe_target(tmp_path):
    target_dir, corpus = make_qwen3_moe_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl", count=40)
    workdir, out = tmp_path / "run", tmp_path / "export"
    settings = [f"--config.target_dir={target_dir}", f"--config.data.train_files={corpus}",
                "--config.data.seq_len=64", "--config.drafter.sliding_window=24", "--config.mesh.fsdp=1"]
    trained = dflash_jax("train", "--config", TINY, "--workdir", str(workdir), *settings,
                         "--config.total_steps=2", "--config.log_every=1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    evaluated = dflash_jax("evaluate", "--config", TINY, "--workdir", str(workdir), *settings,
                           "--prompts", str(corpus), "--num_prompts", "2", "--max_new_tokens", "12", "--speed",
                           "--json", str(tmp_path / "eval.json"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert figures["trained"]["tau"] >= 1.0
    assert "speculative: τ" in evaluated.stdout and "DDTree (budget" in evaluated.stdout
    assert evaluated.stdout.count("0 outputs differing from it") == 2  # both decoders lossless

    exported = dflash_jax("export", "--workdir", str(workdir), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"vllm serve {target_dir} --speculative-config" in exported.stdout
    _, drafter_config = load_drafter_dir(out)
    assert drafter_config.num_target_layers == 6
