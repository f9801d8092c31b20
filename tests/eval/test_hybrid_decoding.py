"""Speculative decoding on the hybrid Qwen3.5/3.6 target (design §9.3): the decode cache cut back after a
partly rejected verification equals a fresh prefill of the accepted prefix, and speculative generation is
plain greedy decoding token for token, with blocks accepted fully, partly and not at all.

CPU, fp32, a tiny random hybrid target (two periods of [Gated DeltaNet, gated attention]) built in NNX.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.eval.exact_tau import DraftScorer, Example, score_responses
from dflash_jax.eval.generate import SpeculativeGenerator, continue_text
from dflash_jax.models.qwen3_5 import FULL_ATTENTION
from dflash_jax.models.target import NO_SEGMENT
from tests.decode_check import tiny_drafter, tiny_hybrid_target

VOCAB, BLOCK, NEW_TOKENS = 96, 4, 23
PROMPT_LENGTHS = (3, 7, 12)


@pytest.fixture(scope="module")
def target():
    return tiny_hybrid_target(VOCAB)


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(VOCAB, BLOCK)


@pytest.fixture(scope="module")
def generators(target, drafter):
    return {name: SpeculativeGenerator(target, model, prefill_len=16, capacity=48)
            for name, model in (("plain", None), ("speculative", drafter))}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB - 1, n).astype(np.int32) for n in PROMPT_LENGTHS]


def test_cache_cut_back_after_a_partial_acceptance_equals_a_fresh_prefill(target):
    """Prefill 7 tokens, verify a 5-token block keeping every state, keep 1, 3 or all 5 of its tokens: every
    recurrent state, conv input and attention column equals the cache of one prefill over the kept text
    (12 columns, the rest right padding in segment NO_SEGMENT, as the generator prefills)."""
    text = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 12)), jnp.int32)

    @nnx.jit
    def prefill(model, length):
        segments = jnp.where(jnp.arange(12)[None] < length, 0, NO_SEGMENT)
        out = model(text, jnp.arange(12)[None], segments, cache=model.init_cache(1, 16))
        return out.cache._replace(length=length)

    prefilled = prefill(target, jnp.int32(7))
    verified = nnx.jit(lambda model, cache: continue_text(model, text[:, 7:], cache, (), keep_every_state=True)
                       )(target, prefilled).cache
    for kept in (1, 3, 5):
        cut = target.keep_prefix(verified, jnp.int32(7 + kept))
        fresh = prefill(target, jnp.int32(7 + kept))
        assert int(cut.length) == int(fresh.length) == 7 + kept
        for layer_type, got, expected in zip(target.config.layer_period(), cut.layers, fresh.layers):
            for got_array, expected_array in zip(got, expected):
                assert got_array.shape == expected_array.shape
                if layer_type == FULL_ATTENTION:  # columns past the kept text are stale, never read
                    got_array, expected_array = got_array[:, :, :7 + kept], expected_array[:, :, :7 + kept]
                np.testing.assert_allclose(got_array, expected_array, rtol=1e-5, atol=1e-5,
                                           err_msg=f"{layer_type}, {kept} kept")


def forced_generation(generator: SpeculativeGenerator, prompt: np.ndarray, reference: np.ndarray,
                      right_drafts: list[int]) -> tuple[list[int], list[int]]:
    """The generator's own prefill and verification steps, each step verifying drafts of which the first
    right_drafts[s] (cycled) are the reference's next tokens and the rest wrong: (committed tokens, accepted
    drafts per step)."""
    padded = np.zeros((1, generator.prefill_len), np.int32)
    padded[0, :len(prompt)] = prompt
    cache, drafter_cache, bonus, _ = generator._prefill(generator._target_state, generator._drafter_state, padded,
                                                        np.int32(len(prompt)))
    tokens, accepted_per_step = [int(bonus[0])], []
    while len(tokens) < len(reference):
        right = right_drafts[len(accepted_per_step) % len(right_drafts)]
        upcoming = np.resize(reference[len(tokens):], BLOCK - 1)  # past the reference: any tokens
        drafts = np.where(np.arange(BLOCK - 1) < right, upcoming, (upcoming + 1) % VOCAB).astype(np.int32)
        limit = min(BLOCK - 1, len(reference) - len(tokens) - 1)
        cache, drafter_cache, committed, accepted, bonus, _ = generator._verify(cache, drafter_cache, bonus,
                                                                               drafts[None], limit)
        accepted = int(accepted)
        assert accepted == min(right, limit)
        tokens += [int(t) for t in np.asarray(committed[0, :accepted + 1])]
        accepted_per_step.append(accepted)
    return tokens, accepted_per_step


@pytest.mark.parametrize("right_drafts", [[BLOCK - 1], [0], [2, 0, 1, BLOCK - 1]],
                         ids=["all_accepted", "none_accepted", "mixed"])
def test_speculative_steps_commit_plain_greedy_whatever_is_accepted(generators, prompts, right_drafts):
    for prompt in prompts:
        reference = generators["plain"].generate(prompt, NEW_TOKENS).tokens
        tokens, steps = forced_generation(generators["speculative"], prompt, reference, right_drafts)
        np.testing.assert_array_equal(tokens, reference)
        if right_drafts == [BLOCK - 1]:
            assert steps[:-1] == [BLOCK - 1] * (len(steps) - 1)


def test_speculative_generation_is_plain_greedy_and_its_tau_is_exact_tau(target, drafter, generators, prompts):
    """A random drafter through generate(): the plain greedy output, and the acceptance lengths exact τ
    walks on the same continuation; that continuation is the uncached forward's greedy one token for token
    (greedy_agreement), so the padded prefill and the cached steps decode as the full forward does."""
    scorer = DraftScorer(target, drafter, top_k=2, length_bucket=64)
    for prompt in prompts:
        plain = generators["plain"].generate(prompt, NEW_TOKENS)
        speculative = generators["speculative"].generate(prompt, NEW_TOKENS)
        np.testing.assert_array_equal(speculative.tokens, plain.tokens)
        response = score_responses(scorer, [Example(prompt, plain.tokens)], budgets=())[0]
        assert response.block_steps == [length - 1 for length in speculative.acceptance_lengths]
        assert response.greedy_agreement[0] == response.greedy_agreement[1]
