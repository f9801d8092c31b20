"""Exact greedy τ (design §9): the walk and its statistics on hand-built drafts, and equality with the τ the
KV-cached speculative generator measures, for a briefly trained drafter whose drafts are partly accepted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.eval.ddtree import accepted_depth, build_tree
from dflash_jax.eval.context_bins import parse_edges
from dflash_jax.eval.exact_tau import (DraftScorer, Example, _score, evaluate_drafter, score_responses,
                                      summarize, summarize_by_context, walk)
from dflash_jax.commands.evaluate import placed
from dflash_jax.eval.generate import SpeculativeGenerator, benchmark
from dflash_jax.models.drafter import Drafter
from dflash_jax.sharding import make_mesh, replicated
from dflash_jax.weights.targets import load_target
from tests.eval_fixtures import BLOCK, VOCAB, drafter_config, target_and_greedy_examples, train_briefly
from tests.hf_fixtures import qwen3_config, save_qwen3

NEW_TOKENS = 28


class FakeScorer:
    """Stands in for DraftScorer: per text length, the drafts (top-1, log-prob 0) and the target's greedy."""

    def __init__(self, outputs: dict[int, tuple[np.ndarray, np.ndarray]]):
        self.outputs = outputs

    def score(self, sequences):
        return [(greedy, drafts[:, :, None], np.zeros(drafts.shape + (1,)))
                for greedy, drafts in (self.outputs[len(sequence)] for sequence in sequences)]


def hand_built(sequence: np.ndarray, runs: dict[int, int], extra: tuple[tuple[int, int], ...] = ()) -> np.ndarray:
    """Drafts [L, B-1] that match `sequence` on the first runs[p] slots of anchor p (plus the (p, k) in
    `extra`) and miss everywhere else."""
    length = len(sequence)
    index = np.arange(length)[:, None] + np.arange(1, BLOCK)[None, :]
    truth = sequence[np.minimum(index, length - 1)]
    right = np.zeros(truth.shape, bool)
    for p, run in runs.items():
        right[p, :run] = True
    for p, k in extra:
        right[p, k - 1] = True
    return np.where(right, truth, (truth + 1) % VOCAB)


def test_walk_statistics_on_hand_built_drafts():
    rng = np.random.default_rng(0)
    # Response A: prompt 2 + continuation 8 tokens; anchor 3 gets slot 2 right but slot 1 wrong.
    text_a = rng.integers(0, VOCAB, 10)
    runs_a = {2: 3, 3: 0, 4: 1, 5: 2, 6: 3, 7: 2, 8: 1}
    greedy_a = np.roll(text_a, -1)  # the target agrees with every continuation token
    # Response B: prompt 1 + continuation 2; the target disagrees with its last token.
    text_b = rng.integers(0, VOCAB, 3)
    greedy_b = np.roll(text_b, -1)
    greedy_b[1] = (greedy_b[1] + 1) % VOCAB
    scorer = FakeScorer({10: (greedy_a, hand_built(text_a, runs_a, extra=((3, 2),))),
                         3: (greedy_b, hand_built(text_b, {1: 0}))})
    responses = [score_responses(scorer, [Example(text_a[:2], text_a[2:])], budgets=(BLOCK - 1,))[0],
                 score_responses(scorer, [Example(text_b[:1], text_b[1:])], budgets=(BLOCK - 1,))[0]]
    # A: anchor 2 accepts 3 -> anchor 6, whose 3 right drafts are capped to 2 so the bonus is the last
    # token (position 9). B: one step, nothing accepted.
    assert responses[0].block_steps == [3, 2] and responses[1].block_steps == [0]
    summary = summarize(responses, BLOCK - 1)
    assert summary["tau"] == pytest.approx((4 + 3 + 1) / 3)  # pooled: committed tokens over steps
    assert summary["tau_per_response"] == pytest.approx(((4 + 3) / 2 + 1) / 2)  # mean of per-response means
    assert summary["accepted_histogram"] == pytest.approx([1 / 3, 0, 1 / 3, 1 / 3])
    assert summary["slot_acceptance"] == pytest.approx([6 / 8, 5 / 6, 2 / 5])
    assert summary["slot_acceptance_conditional"] == pytest.approx([6 / 8, 4 / 5, 2 / 3])
    assert summary["ddtree_tau"] == {BLOCK - 1: pytest.approx(summary["tau"])}  # one candidate: a chain
    assert summary["ddtree_tau_per_response"] == {BLOCK - 1: pytest.approx(summary["tau_per_response"])}
    assert summary["greedy_agreement"] == pytest.approx(9 / 10)
    assert (summary["responses"], summary["verify_steps"]) == (2, 3)
    # By context length (prompt tokens): A's prompt of 2 and B's of 1 on either side of an edge at 2.
    assert [r.context_tokens for r in responses] == [2, 1]
    low, high = summarize_by_context(responses, (2, 1024), BLOCK - 1)
    assert (low["bin"], low["min_tokens"], low["max_tokens"], low["responses"], low["tau"]) == ("0-2", 0, 2, 1, 1.0)
    assert (high["bin"], high["max_tokens"], high["tau"]) == ("2-1K", 1024, pytest.approx((4 + 3) / 2))
    (both,) = summarize_by_context(responses, parse_edges(["4K"]), BLOCK - 1)
    assert both == {"bin": "0-4K", "min_tokens": 0, "max_tokens": 4096, **summary}
    assert summarize_by_context(responses, (2,), BLOCK - 1)[1]["bin"] == "2+"  # the open-ended last bin
    for bad in (["4K", "2K"], ["0"], ["4M"]):
        with pytest.raises(ValueError, match="context bin edge"):
            parse_edges(bad)


def test_examples_need_a_prompt_and_a_continuation():
    scorer = FakeScorer({})
    with pytest.raises(ValueError, match="needs a prompt and a continuation, got 3 and 0 tokens"):
        score_responses(scorer, [Example(np.arange(3), np.arange(0))], budgets=())[0]
    with pytest.raises(ValueError, match="at least one"):
        evaluate_drafter(None, None, [])
    assert walk(lambda p: 5, start=4, end=5) == []  # a one-token continuation needs no verification


def test_exact_tau_equals_the_generators_tau(tmp_path):
    """One test (one training run, whichever xdist worker gets it): a briefly trained drafter whose drafts
    are partly accepted, the KV-cached generators, and the exact-τ forward over the same greedy texts."""
    target, plain, prompts, examples = target_and_greedy_examples(tmp_path, NEW_TOKENS)
    drafter = train_briefly(target, Drafter(drafter_config(), rngs=nnx.Rngs(0)), examples, 30, NEW_TOKENS)
    speculative = SpeculativeGenerator(target, drafter, prefill_len=16, capacity=64)
    scorer = DraftScorer(target, drafter, top_k=8)

    report, plain_runs, speculative_runs = benchmark(plain, speculative, prompts, NEW_TOKENS)
    assert report["outputs_differing_from_plain"] == 0
    responses = [score_responses(scorer, [example], budgets=(3, 8))[0] for example in examples]
    for example, plain_run, speculative_run, response in zip(examples, plain_runs, speculative_runs, responses):
        np.testing.assert_array_equal(speculative_run.tokens, example.continuation_ids)
        np.testing.assert_array_equal(plain_run.tokens, example.continuation_ids)
        assert response.block_steps == [length - 1 for length in speculative_run.acceptance_lengths]
    summary = summarize(responses, BLOCK - 1)
    assert summary["tau"] == pytest.approx(report["tau"], abs=1e-12)
    assert summary["tau_per_response"] == pytest.approx(report["tau_per_response"], abs=1e-12)
    # Mixed outcomes, so the equality above exercises partial acceptance and both caches' cropping.
    histogram = np.asarray(summary["accepted_histogram"])
    assert 1.5 < summary["tau"] < BLOCK - 0.2 and np.all(histogram > 0.02), histogram
    assert summary["greedy_agreement"] == 1.0
    assert set(summary["ddtree_tau"]) == {3, 8} and summary["ddtree_tau"][8] >= 1.0

    check_one_candidate_trees_are_block_drafts(scorer, examples, responses)
    check_stop_tokens_end_responses_as_bonuses(scorer, speculative, examples, speculative_runs)
    result = evaluate_drafter(target, drafter, examples[:3], budgets=(2, 8))  # top-k 8: the compiled forward
    assert set(result) == {"responses", "verify_steps", "tau", "tau_per_response", "accepted_histogram",
                           "slot_acceptance", "slot_acceptance_conditional", "ddtree_tau", "ddtree_tau_per_response",
                           "greedy_agreement"}
    assert result["tau"] == pytest.approx(summarize(responses[:3], BLOCK - 1)["tau"])


def check_one_candidate_trees_are_block_drafts(scorer, examples, responses):
    """DDTree with one candidate per depth and B-1 nodes is the block draft, on the real drafts too."""
    for example, response in zip(examples, responses):
        text = np.concatenate([example.prompt_ids, example.continuation_ids])
        _, tokens, log_probs = scorer(text)
        chain_steps = walk(lambda p: accepted_depth(build_tree(log_probs[p, :, :1], tokens[p, :, :1], BLOCK - 1),
                                                    text[p + 1:]), len(example.prompt_ids), len(text))
        assert chain_steps == response.block_steps


def check_stop_tokens_end_responses_as_bonuses(scorer, speculative, examples, runs):
    """A stop token the drafter gets right is still committed as the step's bonus, so the generator's steps
    stay those of exact τ on the continuation that ends at it."""
    checked = 0
    for example, run in zip(examples, runs):
        position, drafted = 1, []  # continuation indices committed as accepted drafts
        for length in run.acceptance_lengths:
            drafted += range(position, position + length - 1)
            position += length
        continuation = example.continuation_ids
        first_seen = [q for q in drafted if continuation[q] not in continuation[:q]]
        if not first_seen:
            continue
        end = first_seen[len(first_seen) // 2] + 1
        stopped = speculative.generate(example.prompt_ids, NEW_TOKENS, stop_token_ids=(continuation[end - 1],))
        np.testing.assert_array_equal(stopped.tokens, continuation[:end])
        expected = score_responses(scorer, [Example(example.prompt_ids, continuation[:end])], budgets=())[0].block_steps
        assert [length - 1 for length in stopped.acceptance_lengths] == expected
        checked += 1
    assert checked >= 2


def test_batched_scorer_gives_the_one_example_figures(tmp_path):
    """Several texts per forward (design §9.1), their rows split over a (data, fsdp) mesh: texts of different
    lengths and a padded final batch give exactly what one text per forward on one device gives, with one
    compile for the bucket. (Batches on one device: `evaluate_drafter` above.)"""
    save_qwen3(tmp_path, qwen3_config(vocab_size=VOCAB), seed=5)
    target = load_target(tmp_path, param_dtype=jnp.float32)[0]
    drafter = Drafter(drafter_config(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    # Texts of 5..27 tokens, one bucket of 32: a batch of 4 and one of 3 padded with an empty row.
    lengths = [(3, 9), (2, 3), (7, 20), (4, 8), (1, 12), (5, 9), (6, 17)]
    examples = [Example(rng.integers(0, VOCAB, n).astype(np.int32), rng.integers(0, VOCAB, m).astype(np.int32))
                for n, m in lengths]
    texts = [np.concatenate([e.prompt_ids, e.continuation_ids]) for e in examples]
    budgets = (2, 4)
    one = DraftScorer(target, drafter, top_k=4, rows=1, length_bucket=32)
    expected = [one(text) for text in texts]

    mesh = make_mesh(2, 2, 1, devices=jax.devices()[:4])
    batched = DraftScorer(load_target(tmp_path, param_dtype=jnp.float32, mesh=mesh)[0],
                          placed(drafter, drafter.config, jnp.float32, replicated(mesh)), top_k=4, rows=3,
                          length_bucket=32)
    assert batched.rows == 4  # a multiple of data x fsdp
    compiled = _score._cache_size()
    for got, want in zip(batched.score(texts), expected):
        np.testing.assert_array_equal(got[0], want[0])  # the target's greedy tokens
        np.testing.assert_array_equal(got[1], want[1])  # the drafts
        np.testing.assert_allclose(got[2], want[2], rtol=0, atol=1e-6)  # their log-probs
    assert _score._cache_size() == compiled + 1  # the padded batch included
    assert summarize(score_responses(batched, examples, budgets), BLOCK - 1) == summarize(
        [score_responses(one, [example], budgets)[0] for example in examples], BLOCK - 1)
