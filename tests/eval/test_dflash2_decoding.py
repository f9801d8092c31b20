"""DFlash2's evaluation (design §18.3): exact τ, teacher-forced on the target's greedy continuation (each slot's
selector pick after the continuation's previous token), equals the τ of the speculative generator that walks the
selector from the bonus token, whose output is plain greedy decoding token for token; the selector changes the
drafts (so the equality is not the unary argmax's); DDTree is refused, and its figures are left out; the
`evaluate` command measures a DFlash2 export, with --speed and --benchmark."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict
from transformers import AutoTokenizer

from configs import toy as toy_recipe
from dflash_jax.commands import evaluate

from dflash_jax.eval.ddtree_decode import DDTreeGenerator
from dflash_jax.eval.exact_tau import DraftScorer, evaluate_drafter, score_responses, summarize
from dflash_jax.eval.generate import SpeculativeGenerator, benchmark
from dflash_jax.eval.report import format_result
from dflash_jax.models.drafter import Drafter
from dflash_jax.train import validate
from dflash_jax.weights.drafter_files import export_drafter
from dflash_jax.weights.targets import load_target
from tests.eval_fixtures import BLOCK, drafter_config, target_and_greedy_examples, train_briefly

NEW_TOKENS = 28
DFLASH2 = dict(method="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def test_exact_tau_equals_the_selector_walks_tau(tmp_path):
    target, plain, prompts, examples = target_and_greedy_examples(tmp_path, NEW_TOKENS)
    drafter = Drafter(dataclasses.replace(drafter_config(), **DFLASH2), rngs=nnx.Rngs(0))
    # Convolutions away from the identity and transitions on the logits' scale, then the unary drafts trained.
    keys = iter(jax.random.split(jax.random.key(1), 8))
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            projection = conv.kernel_projection.kernel
            projection.set_value(0.1 * jax.random.normal(next(keys), projection.shape))
    selector = drafter.candidate_selector
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        codebook.set_value(codebook[...] * 60)
    drafter = train_briefly(target, drafter, examples, 30, NEW_TOKENS)
    speculative = SpeculativeGenerator(target, drafter, prefill_len=16, capacity=64)

    report, plain_runs, speculative_runs = benchmark(plain, speculative, prompts, NEW_TOKENS)
    assert report["outputs_differing_from_plain"] == 0
    scorer = DraftScorer(target, drafter, top_k=1)
    responses = score_responses(scorer, examples, budgets=())
    for example, speculative_run, response in zip(examples, speculative_runs, responses):
        np.testing.assert_array_equal(speculative_run.tokens, example.continuation_ids)
        assert response.block_steps == [length - 1 for length in speculative_run.acceptance_lengths]
    summary = summarize(responses, BLOCK)
    assert summary["tau"] == pytest.approx(report["tau"], abs=1e-12)
    histogram = np.asarray(summary["accepted_histogram"])
    assert 1.3 < summary["tau"] < BLOCK - 0.2 and np.sum(histogram > 0) >= 3, histogram

    # The selector's picks are not the unary argmax everywhere: with its transitions at 0 it drafts other tokens.
    texts = [np.concatenate([e.prompt_ids, e.continuation_ids]) for e in examples]
    picks = [scores[1] for scores in scorer.score(texts)]
    unary = nnx.clone(drafter)
    unary.candidate_selector.successor_codebook.set_value(jnp.zeros_like(selector.successor_codebook[...]))
    argmaxes = [scores[1] for scores in DraftScorer(target, unary, top_k=1).score(texts)]
    assert any((a != b).any() for a, b in zip(picks, argmaxes))

    result = evaluate_drafter(target, drafter, examples[:3], budgets=(2, 8))  # DDTree not defined: no figures
    assert result["ddtree_tau"] == {} and result["tau"] == pytest.approx(summarize(responses[:3], BLOCK)["tau"])
    assert "DDTree τ: not defined for this drafter" in format_result("trained", result)
    with pytest.raises(ValueError, match="DDTree is not defined for a 'dflash2' drafter"):
        DDTreeGenerator(target, drafter, budget=8, prefill_len=16, capacity=64)



@pytest.mark.slow  # the toy target's generators, twice (about two minutes on one core)
def test_evaluate_measures_a_dflash2_export_with_speed_and_benchmarks(tmp_path):
    """`evaluate` on a DFlash2 export: exact τ equal to the speculative decoder's, lossless, no DDTree decoder
    or figures; `--benchmark` with `--speed` gives the table without DDTree columns."""
    config = toy_recipe.get_config()
    config.mesh = ConfigDict(dict(data=1, fsdp=1, tensor=1, dcn_data=1))
    config.drafter.num_hidden_layers, config.drafter.layer_types = 1, ("full_attention",)
    config.drafter.method = "dflash2"
    config.eval_prompts = 2
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    _, target_config = load_target(config.target_dir, param_dtype=np.float32)
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer)
    drafter = Drafter(drafter_config, rngs=nnx.Rngs(1))
    for codebook in (drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook):
        codebook.set_value(codebook[...] * 60)
    export = export_drafter(drafter, drafter_config, tmp_path / "drafter")

    lines = []
    results = evaluate.run(config, workdir=None, drafter_dir=str(export), max_new_tokens=12, budgets=(4, 8),
                           speed=True, log=lines.append)
    speed = results["speed"]
    assert speed["outputs_differing_from_plain"] == 0 and "ddtree" not in speed
    assert speed["tau"] == pytest.approx(results["trained"]["tau"])
    assert set(speed["tokens_per_second"]) == {"plain", "speculative"}
    assert results["trained"]["ddtree_tau"] == {} and results["untrained"]["ddtree_tau"] == {}
    assert sum("DDTree τ: not defined for this drafter" in line for line in lines) == 2

    humaneval = tmp_path / "humaneval.jsonl"  # the column HumanEval's prompts are made of
    humaneval.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n"}) + "\n"
                                 for i in range(2)))
    results = evaluate.run(config, workdir=None, drafter_dir=str(export), benchmarks=[f"humaneval={humaneval}"],
                           num_prompts=2, max_new_tokens=6, budgets=(4,), speed=True, log=lines.append)
    score = results["benchmarks"]["humaneval"]
    assert score["speed"]["outputs_differing_from_plain"] == 0
    assert score["speed"]["tau"] == pytest.approx(score["tau"])
    assert lines[-1].splitlines()[0] == ("| benchmark | prompts | responses | τ | τ per response | plain tok/s | "
                                         "speculative tok/s | speed-up |")
