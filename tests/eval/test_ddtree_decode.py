"""The DDTree decoder (design §9.4): the tree attention mask, one tree pass against plain forwards over each
node's path and the kept path's cache against a fresh prefill, and decoding that equals plain greedy decoding
with the offline DDTree τ's accepted depths.

CPU, fp32, tiny random targets of both families (Qwen3; Qwen3.5 with Gated DeltaNet) and a drafter, in NNX.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.eval.ddtree import DraftTree, accepted_depth, build_tree, verification_tree
from dflash_jax.eval.ddtree_decode import DDTreeGenerator
from dflash_jax.eval.exact_tau import DraftScorer, Example, score_responses
from dflash_jax.eval.generate import SpeculativeGenerator, continue_text
from dflash_jax.models.qwen3 import KVCache, Qwen3, Qwen3Config
from tests.decode_check import tiny_drafter, tiny_hybrid_target

VOCAB, BLOCK, BUDGET, NEW_TOKENS = 96, 4, 6, 23
PROMPT_LENGTHS = (3, 7, 12)


@pytest.fixture(scope="module")
def targets():
    dense = Qwen3(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
                  rngs=nnx.Rngs(5))
    return {"dense": dense, "hybrid": tiny_hybrid_target(VOCAB)}


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(VOCAB, BLOCK)


@pytest.fixture(scope="module")
def generators(targets, drafter):
    return {family: {"plain": SpeculativeGenerator(target, None, prefill_len=16, capacity=48),
                     "ddtree": DDTreeGenerator(target, drafter, budget=BUDGET, prefill_len=16, capacity=48)}
            for family, target in targets.items()}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB - 1, n).astype(np.int32) for n in PROMPT_LENGTHS]


def random_tree(rng: np.random.Generator, budget: int) -> DraftTree:
    log_probs = np.sort(np.log(rng.dirichlet(np.ones(5), size=BLOCK - 1)), axis=1)[:, ::-1]
    tokens = np.stack([rng.permutation(VOCAB - 1)[:5] for _ in range(BLOCK - 1)])
    return build_tree(log_probs, tokens, budget)


def test_tree_mask_is_the_transitive_closure_of_the_parent_relation():
    """Row i sees j iff j is i or an ancestor: the reflexive transitive closure of the parent matrix, by
    repeated boolean matrix products."""
    rng = np.random.default_rng(3)
    for budget in (1, 4, 9):
        tree = verification_tree(random_tree(rng, budget), bonus=7, size=budget + 3)
        size = len(tree.tokens)
        parent_of = np.zeros((size, size), bool)
        for node, parent in enumerate(tree.parents):
            if parent >= 0:
                parent_of[node, parent] = True
        closure = np.eye(size, dtype=bool)
        for _ in range(size):
            closure = closure | ((closure.astype(int) @ parent_of.astype(int)) > 0)
        np.testing.assert_array_equal(tree.visible, closure)
        assert tree.visible[budget + 1:].sum() == 2 and tree.parents[budget + 1:].tolist() == [-2, -2]  # padding


def cache_arrays(cache, length: int) -> list[np.ndarray]:
    """Every array of a decode cache that the next call reads: K/V columns before `length`, Gated DeltaNet
    conv inputs and states whole."""
    if isinstance(cache, KVCache):
        return [np.asarray(cache.keys[:, :, :length]), np.asarray(cache.values[:, :, :length])]
    return [np.asarray(array[:, :, :length] if array.ndim == 5 and array.shape[2] == cache.segment_ids.shape[1]
                       else array) for arrays in cache.layers for array in arrays]


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_one_tree_pass_gives_each_node_what_a_forward_over_its_path_gives(targets, family):
    """After a cached prefix, a tree verified in one pass: every node's hidden state equals the uncached
    forward's over prefix + that node's root path (the tree mask, depth positions, and for the hybrid target
    each Gated DeltaNet token following its own path); keeping one path leaves the cache a fresh prefill of
    prefix + path leaves."""
    target, rng = targets[family], np.random.default_rng(4)
    prefix = rng.integers(0, VOCAB, 6).astype(np.int32)
    tree = verification_tree(random_tree(rng, 7), bonus=11, size=9)
    forward = nnx.jit(lambda model, ids, cache: continue_text(model, ids, cache, ()))
    cache = forward(target, jnp.asarray(prefix[None]), target.init_cache(1, 32)).cache
    tree_pass = nnx.jit(lambda model, cache: model(jnp.asarray(tree.tokens[None]), 6 + jnp.asarray(tree.depths[None]),
                                                   jnp.zeros((1, 9), jnp.int32), cache=cache,
                                                   tree=jnp.asarray(tree.visible[None])))
    out = tree_pass(target, cache)
    full = nnx.jit(lambda model, ids: model(ids, jnp.arange(16)[None], jnp.ones((1, 16), jnp.int32)).hidden)
    paths = []
    for node in range(8):  # the padding node is no tree node
        path = [node]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        paths.append(path[::-1])
        text = np.zeros((1, 16), np.int32)  # padded after the text: causal, so it changes nothing before
        text[0, :6 + len(path)] = np.concatenate([prefix, tree.tokens[path[::-1]]])
        hidden = full(target, jnp.asarray(text))
        np.testing.assert_allclose(out.hidden[0, node], hidden[0, 5 + len(path)], rtol=1e-5, atol=1e-5,
                                   err_msg=f"node {node}")
    deepest = max(paths, key=len)
    order = np.zeros(9, np.int32)
    order[:len(deepest)] = deepest
    kept = target.keep_path(out.cache, jnp.int32(6), jnp.asarray(order), jnp.int32(6 + len(deepest)))
    fresh = forward(target, jnp.asarray(np.concatenate([prefix, tree.tokens[deepest]])[None]),
                    target.init_cache(1, 32)).cache
    assert int(kept.length) == int(fresh.length) == 6 + len(deepest)
    for got, expected in zip(cache_arrays(kept, 6 + len(deepest)), cache_arrays(fresh, 6 + len(deepest)),
                             strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def forced_drafts(rng: np.random.Generator, upcoming: np.ndarray, ranks: np.ndarray):
    """Top-k drafts per slot ([1, B-1, k] tokens and log-probs) holding upcoming[d] at rank ranks[d]
    (rank >= k: absent), like a drafter that has it among its guesses; rank 0 is confident (0.9)."""
    top_k = min(BUDGET, VOCAB)
    tokens = np.zeros((1, BLOCK - 1, top_k), np.int32)
    for depth in range(BLOCK - 1):
        others = [t for t in rng.permutation(VOCAB) if t != upcoming[depth]][:top_k]
        if ranks[depth] < top_k:
            others[ranks[depth]] = upcoming[depth]
        tokens[0, depth] = others
    rest = 0.1 * np.sort(rng.dirichlet(np.ones(top_k - 1), size=(1, BLOCK - 1)), axis=-1)[..., ::-1]
    log_probs = np.log(np.concatenate([np.full((1, BLOCK - 1, 1), 0.9), rest], axis=-1))
    return jnp.asarray(tokens), jnp.asarray(log_probs.astype(np.float32))


def test_tree_steps_commit_plain_greedy_and_accept_the_offline_depth(generators, prompts):
    """The decoder's own steps on drafts holding the target's next tokens at chosen ranks (all first: a
    trained-like drafter; mixed; absent): it commits plain greedy decoding, and each step accepts what
    `accepted_depth` finds in the same tree offline."""
    generator, rng, seen = generators["dense"]["ddtree"], np.random.default_rng(5), set()
    for prompt, ranks_choices in zip(prompts, ([0, 0, 0], [0, 1, 3], [BUDGET, 0, 0])):
        reference = generators["dense"]["plain"].generate(prompt, NEW_TOKENS).tokens
        padded = np.zeros((1, generator.prefill_len), np.int32)
        padded[0, :len(prompt)] = prompt
        cache, drafter_cache, bonus, _ = generator._prefill(generator._target_state, generator._drafter_state,
                                                            padded, np.int32(len(prompt)))
        tokens, depths = [int(bonus[0])], []
        while len(tokens) < len(reference):
            upcoming = np.resize(reference[len(tokens):], BLOCK - 1)
            drafts = forced_drafts(rng, upcoming, np.asarray(ranks_choices))
            limit = min(BLOCK - 1, len(reference) - len(tokens) - 1)
            tree = build_tree(np.asarray(drafts[1][0]), np.asarray(drafts[0][0]), BUDGET)
            expected = min(accepted_depth(tree, reference[len(tokens):]), limit)
            cache, drafter_cache, committed, accepted, bonus, _ = generator._verify(cache, drafter_cache, bonus,
                                                                                    drafts, limit)
            assert int(accepted) == expected
            tokens += [int(t) for t in np.asarray(committed[0, :int(accepted) + 1])]
            depths.append(int(accepted))
        np.testing.assert_array_equal(tokens, reference)
        if ranks_choices == [0, 0, 0]:
            assert depths[:-1] == [BLOCK - 1] * (len(depths) - 1)
        seen.update(depths)
    assert {0, BLOCK - 1} < seen  # trees accepted fully, partly and not at all


# The hybrid run is also in test_evaluate.py's slow hybrid test (--speed); here it would add its compiles.
@pytest.mark.parametrize("family", ["dense", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_ddtree_generation_is_plain_greedy_with_the_offline_ddtree_steps(targets, drafter, generators, prompts,
                                                                         family):
    """A random drafter through generate(): plain greedy output, and per step the accepted depths the
    offline DDTree τ walks on the same continuation with the same budget."""
    scorer = DraftScorer(targets[family], drafter, top_k=BUDGET, length_bucket=64)
    for prompt in prompts:
        plain = generators[family]["plain"].generate(prompt, NEW_TOKENS)
        tree_run = generators[family]["ddtree"].generate(prompt, NEW_TOKENS)
        np.testing.assert_array_equal(tree_run.tokens, plain.tokens)
        response = score_responses(scorer, [Example(prompt, plain.tokens)], budgets=(BUDGET,))[0]
        assert response.tree_steps[BUDGET] == [length - 1 for length in tree_run.acceptance_lengths]
