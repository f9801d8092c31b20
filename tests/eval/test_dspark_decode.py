"""DSpark's evaluation (design §18.2): exact τ, teacher-forced with the text's tokens as the Markov bias's previous
tokens, equals the τ the KV-cached speculative generator commits while drafting left to right with the bias of
its own previous draft; that generator's output is plain greedy decoding; DDTree is refused."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.eval.ddtree_decode import DDTreeGenerator
from dflash_jax.eval.exact_tau import DraftScorer, evaluate_drafter, score_responses, summarize
from dflash_jax.eval.generate import SpeculativeGenerator, benchmark
from dflash_jax.models.drafter import Drafter
from tests.eval_fixtures import BLOCK, VOCAB, drafter_config, target_and_greedy_examples, train_briefly

NEW_TOKENS = 28


def test_markov_chain_matches_a_loop():
    """`greedy_chain` is the left-to-right argmax of base + W2·W1[previous draft], the first previous the bonus."""
    drafter = Drafter(drafter_config("dspark"), rngs=nnx.Rngs(3))
    head = drafter.markov_head
    rng = np.random.default_rng(0)
    base = rng.standard_normal((2, BLOCK, VOCAB)).astype(np.float32)
    bonus = np.asarray([5, 17], np.int32)
    w1, w2 = np.asarray(head.w1[...]) * 300, np.asarray(head.w2[...])  # a bias on the logits' scale
    head.w1.set_value(jnp.asarray(w1))
    got = np.asarray(head.greedy_chain(jnp.asarray(base), jnp.asarray(bonus), jnp.float32))
    for row in range(2):
        previous, expected = bonus[row], []
        for k in range(BLOCK):
            previous = int(np.argmax(base[row, k] + w1[previous] @ w2))
            expected.append(previous)
        np.testing.assert_array_equal(got[row], expected)
    assert (got != base.argmax(-1)).any()  # the bias changed some drafts


def test_exact_tau_equals_the_dspark_generators_tau(tmp_path):
    target, plain, prompts, examples = target_and_greedy_examples(tmp_path, NEW_TOKENS)
    drafter = Drafter(drafter_config("dspark"), rngs=nnx.Rngs(0))
    # A Markov bias on the logits' scale from the start (its N(0, 0.01²) W1 would barely move the drafts).
    drafter.markov_head.w1.set_value(drafter.markov_head.w1[...] * 100)
    drafter = train_briefly(target, drafter, examples, 30, NEW_TOKENS)
    speculative = SpeculativeGenerator(target, drafter, prefill_len=16, capacity=64)
    assert speculative.verify_width == BLOCK + 1  # the bonus and B drafts

    report, plain_runs, speculative_runs = benchmark(plain, speculative, prompts, NEW_TOKENS)
    assert report["outputs_differing_from_plain"] == 0 and "ddtree" not in report
    scorer = DraftScorer(target, drafter, top_k=1)
    responses = score_responses(scorer, examples, budgets=())
    for example, plain_run, speculative_run, response in zip(examples, plain_runs, speculative_runs, responses):
        np.testing.assert_array_equal(speculative_run.tokens, example.continuation_ids)
        np.testing.assert_array_equal(plain_run.tokens, example.continuation_ids)
        assert response.block_steps == [length - 1 for length in speculative_run.acceptance_lengths]
    summary = summarize(responses, BLOCK)
    assert summary["tau"] == pytest.approx(report["tau"], abs=1e-12)
    # Mixed outcomes, every draft count 0..B among them: partial acceptance, the cropping of both caches, and
    # the first draft (slot 0's, which DFlash has not) accepted.
    histogram = np.asarray(summary["accepted_histogram"])
    assert len(histogram) == BLOCK + 1 and 1.5 < summary["tau"] < BLOCK and np.all(histogram > 0.01), histogram

    # The Markov bias decides drafts here: without it the teacher-forced drafts differ.
    without = Drafter(drafter.config, rngs=nnx.Rngs(0))
    nnx.update(without, nnx.state(drafter))
    without.markov_head.w2.set_value(jnp.zeros_like(without.markov_head.w2[...]))
    text = np.concatenate([examples[0].prompt_ids, examples[0].continuation_ids])
    assert (scorer(text)[1] != DraftScorer(target, without, top_k=1)(text)[1]).mean() > 0.05

    result = evaluate_drafter(target, drafter, examples[:3], budgets=(2, 8))
    assert result["ddtree_tau"] == {} and result["tau"] == pytest.approx(summarize(responses[:3], BLOCK)["tau"])
    with pytest.raises(ValueError, match="DDTree is not defined for a 'dspark' drafter"):
        DDTreeGenerator(target, drafter, budget=8, prefill_len=16, capacity=64)
