"""The whole workflow against the mixture-of-experts targets (qwen3_moe, qwen3_5_moe), as a user runs it through
the console script: `train`, the same command again with more steps (it resumes), `convert` to Orbax, `evaluate`
from the Orbax target (exact τ; the speculative and DDTree decoders lossless against plain greedy), `export`,
`regenerate` in JAX and `evaluate --benchmark` of the exported drafter. Exact resume and greedy decoding against
transformers' are checked in process (tests/train/test_train_resume.py, tests/eval/test_moe_decoding.py)."""

from __future__ import annotations

import json

import pytest

from dflash_jax.weights.drafter_files import load_drafter_dir
from dflash_jax.weights.orbax_target import is_orbax_target
from tests.command import dflash_jax
from tests.train_fixtures import make_qwen3_5_moe_target, make_qwen3_moe_target, write_corpus

TINY = "configs/tiny.py"
TARGETS = {"qwen3_moe": (make_qwen3_moe_target, [], 6),
           # no dense MLP width for the drafter to copy
           "qwen3_5_moe": (make_qwen3_5_moe_target, ["--config.drafter.intermediate_size=96"], 8)}


def _steps(workdir) -> list[int]:
    return [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _settings(family: str, target_dir, corpus) -> list[str]:
    return [f"--config.target_dir={target_dir}", f"--config.data.train_files={corpus}", "--config.data.seq_len=64",
            "--config.drafter.sliding_window=24", "--config.mesh.fsdp=1", *TARGETS[family][1]]


def _train(workdir, settings: list[str], steps: int):
    result = dflash_jax("train", "--config", TINY, "--workdir", str(workdir), *settings,
                        f"--config.total_steps={steps}", "--config.log_every=1")
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_train_and_export_a_drafter_for_a_moe_target(tmp_path):
    """make test's share: two steps through `dflash-jax train` against a tiny Qwen3-MoE, then `export`."""
    target_dir = make_qwen3_moe_target(tmp_path / "target")
    settings = _settings("qwen3_moe", target_dir, write_corpus(tmp_path / "train.jsonl", count=40))
    _train(tmp_path / "run", settings, 2)
    assert _steps(tmp_path / "run") == [1, 2]
    exported = dflash_jax("export", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert load_drafter_dir(tmp_path / "export")[1].num_target_layers == 6


@pytest.mark.slow  # eight commands through the console script per family
@pytest.mark.parametrize("family", list(TARGETS))
def test_train_resume_evaluate_export_regenerate_and_benchmark_for_a_moe_target(tmp_path, family):
    make, _, num_layers = TARGETS[family]
    target_dir, corpus = make(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl", count=40)
    workdir, out, orbax = tmp_path / "run", tmp_path / "export", tmp_path / "orbax"
    settings = _settings(family, target_dir, corpus)

    _train(workdir, settings, 2)
    assert _steps(workdir) == [1, 2]
    resumed = _train(workdir, settings, 4)  # the same command with more steps continues from step 2's checkpoint
    assert f"resuming from {workdir / 'checkpoints'} at step 2" in resumed.stderr
    assert _steps(workdir) == [1, 2, 3, 4]

    converted = dflash_jax("convert", "--hf_dir", str(target_dir), "--out", str(orbax))
    assert converted.returncode == 0 and is_orbax_target(orbax), converted.stderr[-3000:]
    evaluated = dflash_jax("evaluate", "--config", TINY, "--workdir", str(workdir), *settings,
                           f"--config.target_dir={orbax}", "--prompts", str(corpus), "--num_prompts", "2",
                           "--max_new_tokens", "12", "--speed", "--json", str(tmp_path / "eval.json"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["trained"]["tau"] >= 1.0
    assert "speculative: τ" in evaluated.stdout and "DDTree (budget" in evaluated.stdout
    assert evaluated.stdout.count("0 outputs differing from it") == 2  # both decoders lossless

    exported = dflash_jax("export", "--workdir", str(workdir), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"vllm serve {target_dir} --speculative-config" in exported.stdout
    assert load_drafter_dir(out)[1].num_target_layers == num_layers

    regenerated = dflash_jax("regenerate", "--config", TINY, f"--config.target_dir={target_dir}", "--prompts",
                             str(corpus), "--out", str(tmp_path / "regenerated.jsonl"), "--max_new_tokens", "8",
                             "--batch_size", "8", "--quiet")
    assert regenerated.returncode == 0, regenerated.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "regenerated.jsonl").read_text().splitlines()]
    assert "(40 input records done)" in regenerated.stderr  # empty completions are dropped, and counted
    assert len(records) > 30 and all(set(r) == {"prompt", "completion"} and r["completion"] for r in records)

    questions = tmp_path / "gsm8k.jsonl"
    questions.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
                                 for i in range(3)))
    benchmarked = dflash_jax("evaluate", "--config", TINY, *settings, "--drafter", str(out), "--benchmark",
                             f"gsm8k={questions}", "--num_prompts", "2", "--max_new_tokens", "8", "--budgets", "4",
                             "--json", str(tmp_path / "bench.json"))
    assert benchmarked.returncode == 0, benchmarked.stderr[-3000:]
    score = json.loads((tmp_path / "bench.json").read_text())["benchmarks"]["gsm8k"]
    assert (score["prompts"], score["responses"]) == (2, 2) and score["tau"] >= 1.0
