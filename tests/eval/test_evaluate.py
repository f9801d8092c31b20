"""The evaluation CLI (`python -m dflash_jax.evaluate`) and the train-loop hook, end to end on a tiny random
target with a tokenizer and an exported drafter."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from dflash_jax.commands import evaluate
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.eval.examples import read_examples
from dflash_jax.eval.report import flat_metrics
from dflash_jax.eval.train_hook import make_train_evaluator
from dflash_jax.models.drafter import Drafter
from dflash_jax.weights.targets import load_target
from dflash_jax.train import validate
from dflash_jax.weights.drafter_files import export_drafter, load_drafter_dir
from tests.process_fixtures import REPO, outputs_of, start_two_processes
from tests.train_fixtures import make_qwen3_5_target, make_target, tiny_config, write_corpus


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(config, exported drafter directory, its config) for a random target with the test tokenizer."""
    base = tmp_path_factory.mktemp("evaluate")
    target_dir = make_target(base / "target")
    corpus = write_corpus(base / "eval.jsonl", count=5)
    config = tiny_config(target_dir, corpus, eval_prompts=3, eval_max_new_tokens=12,
                         **{"data.eval_files": (str(corpus),), "drafter.target_layer_ids": (1, 3)})
    _, target_config = load_target(target_dir)
    drafter_config = validate.resolve_drafter_config(config, target_config, AutoTokenizer.from_pretrained(target_dir))
    export = export_drafter(Drafter(drafter_config, rngs=nnx.Rngs(1)), drafter_config, base / "export")
    return config, export, drafter_config


def test_examples_split_at_the_last_trained_span(setup):
    config, _, _ = setup
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    examples = read_examples(config.data.eval_files, tokenizer, limit=2, max_continuation=4)
    records = [json.loads(line) for line in open(config.data.eval_files[0])][:2]
    assert len(examples) == 2
    for example, record in zip(examples, records):
        assert tokenizer.decode(example.prompt_ids) == record["prompt"]
        full = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        np.testing.assert_array_equal(example.continuation_ids, full[:4])


def test_cli_reports_trained_and_untrained_figures_and_speed(setup, tmp_path):
    config, export, drafter_config = setup
    lines = []
    results = evaluate.run(config, workdir=None, drafter_dir=str(export), max_new_tokens=12, budgets=(4, 8),
                           speed=True, log=lines.append)
    for name in ("trained", "untrained"):
        result = results[name]
        assert result["responses"] == 3 and result["greedy_agreement"] == 1.0  # generated continuations
        assert len(result["accepted_histogram"]) == drafter_config.block_size
        assert set(result["ddtree_tau"]) == {4, 8} and 1.0 <= result["tau"] <= drafter_config.block_size
    speed = results["speed"]
    assert speed["outputs_differing_from_plain"] == 0 and speed["ddtree"]["outputs_differing_from_plain"] == 0
    assert speed["tau"] == pytest.approx(results["trained"]["tau"])  # exact τ is the generator's
    assert speed["tau_per_response"] == pytest.approx(results["trained"]["tau_per_response"])
    assert speed["ddtree"]["budget"] == 8  # the largest budget; its τ is the offline DDTree τ
    assert speed["ddtree"]["tau"] == pytest.approx(results["trained"]["ddtree_tau"][8])
    assert set(speed["tokens_per_second"]) == {"plain", "speculative", "ddtree"}
    assert any(line.startswith("decode tokens/s: plain ") for line in lines)
    assert any(line.startswith("untrained drafter: τ = ") for line in lines)
    json.dumps(results)  # the --json output

    data = evaluate.run(config, workdir=None, drafter_dir=str(export), continuation="data", max_new_tokens=12,
                        log=lines.append)
    assert data["continuation"] == "data" and "speed" not in data


def test_tau_by_context_length_splits_the_responses_by_prompt_tokens(setup, tmp_path):
    """Prompt-only records (a raw prompt, a chat ending with the user) are continued by the target; τ per bin
    of prompt length pools exactly the bin's responses (design §9.7)."""
    config, export, _ = setup
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    prompts = tmp_path / "prompts.jsonl"
    records = [{"prompt": "a b"}, {"prompt": " ".join(["a b c d"] * 6)},
               {"messages": [{"role": "user", "content": "hello there"}]}]
    prompts.write_text("".join(json.dumps(record) + "\n" for record in records))
    lengths = [len(e.prompt_ids) for e in read_examples([prompts], tokenizer, 3, generate=True)]
    assert lengths[1] > lengths[0]
    edges = (lengths[0] + 1,)  # the first prompt alone in the first bin
    lines = []
    results = evaluate.run(config, workdir=None, drafter_dir=str(export), prompts=[str(prompts)],
                           continuation="generate", max_new_tokens=12, budgets=(4,), context_edges=edges,
                           log=lines.append)
    for name in ("trained", "untrained"):
        result, bins = results[name], results[name]["by_context"]
        expected_counts = [sum(length < edges[0] for length in lengths), sum(length >= edges[0] for length in lengths)]
        assert [b["responses"] for b in bins] == [c for c in expected_counts if c]
        assert [b["bin"] for b in bins] == [label for label, c in zip((f"0-{edges[0]}", f"{edges[0]}+"),
                                                                      expected_counts) if c]
        committed = sum(b["tau"] * b["verify_steps"] for b in bins)  # pooled τ = committed tokens / steps
        assert committed == pytest.approx(result["tau"] * result["verify_steps"])
    assert any(line.startswith("τ by context length (prompt tokens):") for line in lines)
    with pytest.raises(Exception, match="missing 'completion'"):  # a prompt alone has no data continuation
        evaluate.run(config, workdir=None, drafter_dir=str(export), prompts=[str(prompts)], continuation="data",
                     log=lines.append)


def test_train_hook_measures_what_evaluate_measures(setup):
    """By default both score generated greedy continuations of the same prompts: the same figures."""
    config, export, _ = setup
    target, _ = load_target(config.target_dir)
    drafter, _ = load_drafter_dir(export)
    metrics = make_train_evaluator(config, budgets=(4, 8))(100, drafter, target)
    assert {"tau", "tau_per_response", "greedy_agreement", "acc_1", "acc_given_prev_1", "accepted_share_0",
            "ddtree_tau_8", "ddtree_tau_per_response_8"} <= set(metrics)
    assert all(isinstance(value, float) for value in metrics.values())
    assert metrics["greedy_agreement"] == 1.0  # generated, not the records' own continuations
    expected = evaluate.run(config, workdir=None, drafter_dir=str(export), budgets=(4, 8), log=lambda _: None)
    assert metrics == pytest.approx(flat_metrics(expected["trained"]), abs=1e-9)


# slow: two processes start, compile and generate on 2 cores (about a minute; make test's budget)
@pytest.mark.slow
def test_two_processes_evaluate_like_one(setup, tmp_path, monkeypatch):
    """`python -m dflash_jax.evaluate` as two processes of four CPU devices (jax.distributed): each generates and
    scores its share of the prompts (two and one) on its own devices, and process 0 writes what one process of
    eight devices reports. The command keeps its compiles in config.compilation_cache_dir."""
    config, export, _ = setup
    config = config.copy_and_resolve_references()
    config.mesh.fsdp = -1  # every device: one process's rows over eight, each process's over its four
    one = evaluate.run(config, workdir=None, drafter_dir=str(export), budgets=(4, 8), log=lambda _: None)
    command = [sys.executable, "-m", "dflash_jax.evaluate", "--config", str(REPO / "configs" / "tiny.py"),
               "--drafter", str(export), "--budgets=4,8", "--json", str(tmp_path / "two.json"),
               f"--config.compilation_cache_dir={tmp_path / 'cache'}",
               *(f"--config.{key}={value}" for key, value in (
                   ("target_dir", config.target_dir), ("data.eval_files", config.data.eval_files[0]),
                   ("eval_prompts", config.eval_prompts), ("eval_max_new_tokens", config.eval_max_new_tokens),
                   ("target_dtype", "float32"), ("compute_dtype", "float32"),
                   ("loss.vocab_chunk", config.loss.vocab_chunk)))]
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the tiny programs compile fast
    outputs = outputs_of(start_two_processes(command))
    assert any((tmp_path / "cache").iterdir())
    assert "generating greedy continuations of 2 prompts (up to 12 tokens) on each of 2 processes" in outputs[0]
    assert "drafter: τ = " in outputs[0] and "drafter: τ = " not in outputs[1]  # process 0 alone prints
    two = json.loads((tmp_path / "two.json").read_text())
    assert two == json.loads(json.dumps(one))


def test_setup_errors_are_sentences(setup):
    config, export, drafter_config = setup
    with pytest.raises(ConfigError, match="give --workdir"):
        evaluate.run(config, workdir=None)
    other = dataclasses.replace(drafter_config, num_target_layers=3, target_layer_ids=(0, 2))
    mismatched = export_drafter(Drafter(other, rngs=nnx.Rngs(0)), other, export.parent / "other")
    with pytest.raises(ConfigError, match=r"made for a target with \(layers, vocab, hidden\) = \(3,"):
        evaluate.run(config, workdir=None, drafter_dir=str(mismatched), max_new_tokens=12)
    # Before the target's weights load: a target directory without them gives the drafter's error.
    weightless = export.parent / "weightless_target"
    weightless.mkdir()
    for path in Path(config.target_dir).iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy(path, weightless / path.name)
    config = config.copy_and_resolve_references()
    config.target_dir = str(weightless)
    with pytest.raises(ConfigError, match=r"made for a target with"):
        evaluate.run(config, workdir=None, drafter_dir=str(mismatched))


@pytest.mark.slow
def test_hybrid_target_generates_and_times_speculative_decoding(tmp_path):
    """Qwen3.5/3.6: generated continuations and --speed (speculative and DDTree decoding) work."""
    target_dir = make_qwen3_5_target(tmp_path / "target")
    corpus = write_corpus(tmp_path / "eval.jsonl", count=2)
    config = tiny_config(target_dir, corpus, eval_prompts=2, eval_max_new_tokens=10,
                         **{"data.eval_files": (str(corpus),), "drafter.target_layer_ids": (1, 5)})
    _, target_config = load_target(target_dir)
    drafter_config = validate.resolve_drafter_config(config, target_config, AutoTokenizer.from_pretrained(target_dir))
    export = export_drafter(Drafter(drafter_config, rngs=nnx.Rngs(1)), drafter_config, tmp_path / "export")
    results = evaluate.run(config, workdir=None, drafter_dir=str(export), budgets=(4,), speed=True,
                           log=lambda _: None)
    assert results["trained"]["greedy_agreement"] == 1.0
    assert results["speed"]["outputs_differing_from_plain"] == 0
    assert results["speed"]["tau"] == pytest.approx(results["trained"]["tau"])
    assert results["speed"]["ddtree"]["outputs_differing_from_plain"] == 0
    assert results["speed"]["ddtree"]["tau"] == pytest.approx(results["trained"]["ddtree_tau"][4])
