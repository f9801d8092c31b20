"""DDTree construction and verification (design §9.2) against a brute-force construction, and its
reduction to block drafting with one candidate per depth."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_jax.eval.ddtree import accepted_depth, build_tree
from dflash_jax.eval.exact_tau import leading_matches, walk


def random_lattice(rng: np.random.Generator, depth: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth top-k (log-probs sorted best first, distinct token ids), continuous so no ties."""
    log_probs = -np.sort(rng.exponential(1.0, (depth, top_k)), axis=1)
    tokens = np.stack([rng.permutation(50)[:top_k] for _ in range(depth)])
    return log_probs, tokens


def brute_force(log_probs: np.ndarray, tokens: np.ndarray, budget: int) -> set[tuple[int, ...]]:
    """Every path of the top-k lattice scored by its summed log-prob; the `budget` best token paths."""
    depth, top_k = log_probs.shape
    scored = []
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(top_k), repeat=length):
            score = sum(log_probs[d, r] for d, r in enumerate(ranks))
            scored.append((score, tuple(int(tokens[d, r]) for d, r in enumerate(ranks))))
    scored.sort(key=lambda item: -item[0])
    return {path for _, path in scored[:budget]}


def brute_force_accepted(paths: set[tuple[int, ...]], continuation: np.ndarray) -> int:
    return max([n for n in range(1, len(continuation) + 1) if tuple(int(t) for t in continuation[:n]) in paths],
               default=0)


@pytest.mark.parametrize("depth, top_k, budget", [(3, 3, 1), (3, 3, 7), (4, 3, 22), (5, 2, 12), (4, 4, 60)])
def test_tree_is_the_best_prefix_closed_set(depth, top_k, budget):
    rng = np.random.default_rng(depth * 100 + budget)
    log_probs, tokens = random_lattice(rng, depth, top_k)
    tree = build_tree(log_probs, tokens, budget)
    paths = tree.paths()
    assert len(paths) == budget == len(set(paths))
    assert set(paths) == brute_force(log_probs, tokens, budget)
    assert all(path[:-1] in set(paths) or len(path) == 1 for path in paths)  # prefix-closed
    np.testing.assert_array_equal(tree.depths, [len(path) for path in paths])
    assert np.all(np.diff(tree.scores) <= 1e-12)  # best-first: selected in order of decreasing score

    # Verification: continuations along tree paths (deep acceptance), off them, and random ones.
    continuations = [np.asarray(path + tuple(rng.integers(0, 50, depth))) for path in paths[-3:]]
    continuations += [rng.integers(0, 50, depth) for _ in range(5)] + [np.asarray([tokens[0, 0], 99, 99])]
    for continuation in continuations:
        assert accepted_depth(tree, continuation) == brute_force_accepted(set(paths), continuation)


def test_budget_beyond_the_lattice_takes_every_node():
    log_probs, tokens = random_lattice(np.random.default_rng(0), 3, 2)
    tree = build_tree(log_probs, tokens, budget=100)
    assert len(tree.tokens) == 2 + 4 + 8


def test_one_candidate_per_depth_is_the_block_draft():
    """top-1 per depth with budget B-1: the tree is the greedy chain, and its walk is block τ exactly."""
    rng = np.random.default_rng(1)
    block, length, start = 6, 80, 5
    sequence = rng.integers(0, 4, length)  # a small alphabet, so drafts match often and runs vary
    drafts = rng.integers(0, 4, (length, block - 1))
    log_probs = -rng.exponential(1.0, (length, block - 1, 1))

    chain = build_tree(log_probs[7], drafts[7][:, None], budget=block - 1)
    np.testing.assert_array_equal(chain.tokens, drafts[7])
    np.testing.assert_array_equal(chain.parents, np.arange(-1, block - 2))

    index = np.minimum(np.arange(length)[:, None] + np.arange(1, block)[None, :], length - 1)
    inside = np.arange(length)[:, None] + np.arange(1, block)[None, :] < length
    block_accepted = leading_matches(inside & (drafts == sequence[index]))
    tree_steps = walk(lambda p: accepted_depth(build_tree(log_probs[p], drafts[p][:, None], block - 1),
                                               sequence[p + 1:]), start, length)
    block_steps = walk(lambda p: block_accepted[p], start, length)
    assert tree_steps == block_steps
    assert len(set(block_steps)) > 2  # mixed acceptance lengths, so the equality means something
    assert sum(s + 1 for s in block_steps) == length - 1 - start  # every continuation token committed once


@pytest.mark.parametrize("log_probs, tokens, budget, message", [
    (np.zeros((2, 3)), np.zeros((2, 2)), 4, r"must both be \[depth, top_k\]"),
    (np.zeros(3), np.zeros(3), 4, r"must both be \[depth, top_k\]"),
    (np.zeros((2, 2)), np.zeros((2, 2)), 0, "budget must be >= 1"),
])
def test_bad_inputs_are_refused(log_probs, tokens, budget, message):
    with pytest.raises(ValueError, match=message):
        build_tree(log_probs, tokens, budget)
