"""DDTree draft trees (Ringel & Romano, arXiv 2604.12989; design §9.2) and their greedy verification.

One DFlash forward gives a marginal distribution per draft depth (slot k = depth k). The tree takes the top-k
tokens of every depth and grows best-first: a heap keyed by the accumulated path log-prob, seeded with the
best depth-1 token; each popped node joins the tree and pushes its next sibling (same parent, next-ranked
token of its depth) and its first child (best token of the next depth), until `budget` nodes. Because
log-probs are <= 0 and ranks are sorted, this selects the `budget` highest-scoring paths of the top-k
lattice, a prefix-closed set.

Verification with a greedy target follows the target's own continuation down the tree: the accepted length
is the depth of the longest root path whose tokens equal it (the committed step is that plus the bonus).
`accepted_depth` does it offline; `ddtree_decode.DDTreeGenerator` verifies the tree in one target pass with a
tree attention mask (`verification_tree`, design §9.4).
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """Nodes in the order they were selected. The root (the bonus token) is implicit, index -1."""

    tokens: np.ndarray  # [N] token id of each node
    parents: np.ndarray  # [N] index of the parent node, -1 for depth-1 nodes
    depths: np.ndarray  # [N] depth 1..D = the draft slot the token came from
    scores: np.ndarray  # [N] accumulated log-prob of the path root -> node

    def paths(self) -> list[tuple[int, ...]]:
        """The token path root -> node of every node."""
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens, self.parents):
            paths.append((paths[parent] if parent >= 0 else ()) + (int(token),))
        return paths


def ddtree_defined(config) -> bool:
    """Whether a drafter of this DrafterConfig has a DDTree: its tree takes each depth's top-k from one forward's
    distribution for that depth, the same whatever token the path took above it. DSpark's and DFlash2's draft at
    depth k depends on the token drafted at depth k-1 (the Markov bias, the selector's predecessor), so they have
    none (design §18.2, §18.4)."""
    return config.drafter_method.has_ddtree


def build_tree(log_probs: np.ndarray, tokens: np.ndarray, budget: int) -> DraftTree:
    """log_probs, tokens: [D, K], each depth's top-K tokens, best first. Returns min(budget, all) nodes."""
    log_probs, tokens = np.asarray(log_probs, np.float64), np.asarray(tokens)
    if log_probs.ndim != 2 or log_probs.shape != tokens.shape:
        raise ValueError(f"log_probs {log_probs.shape} and tokens {tokens.shape} must both be [depth, top_k]")
    if budget < 1:
        raise ValueError(f"the DDTree node budget must be >= 1, got {budget}")
    depth_count, rank_count = log_probs.shape
    node_tokens, parents, depths, scores = [], [], [], []
    # Heap entries: (-score, tie-break counter, parent index, depth index, rank).
    heap = [(-log_probs[0, 0], 0, -1, 0, 0)]
    counter = 1
    while heap and len(node_tokens) < budget:
        negative_score, _, parent, depth, rank = heapq.heappop(heap)
        score = -negative_score
        node = len(node_tokens)
        node_tokens.append(tokens[depth, rank])
        parents.append(parent)
        depths.append(depth + 1)
        scores.append(score)
        if rank + 1 < rank_count:  # next sibling: swap this rank's log-prob for the next one's
            sibling = score - log_probs[depth, rank] + log_probs[depth, rank + 1]
            heapq.heappush(heap, (-sibling, counter, parent, depth, rank + 1))
            counter += 1
        if depth + 1 < depth_count:  # first child: the best token of the next depth
            heapq.heappush(heap, (-(score + log_probs[depth + 1, 0]), counter, node, depth + 1, 0))
            counter += 1
    return DraftTree(np.asarray(node_tokens, np.int64), np.asarray(parents, np.int64),
                     np.asarray(depths, np.int64), np.asarray(scores, np.float64))


def accepted_depth(tree: DraftTree, continuation: np.ndarray) -> int:
    """How many tokens of `continuation` (the target's greedy tokens after the bonus) the tree's longest
    matching root path covers."""
    children = {(int(parent), int(token)): node for node, (parent, token) in enumerate(zip(tree.parents,
                                                                                          tree.tokens))}
    node, depth = -1, 0
    for token in continuation:
        node = children.get((node, int(token)))
        if node is None:
            break
        depth += 1
    return depth


@dataclasses.dataclass(frozen=True)
class VerificationTree:
    """A draft tree laid out for one target pass of `size` tokens: index 0 is the root (the bonus token),
    node i of the DraftTree is index i + 1, and indices past the tree are padding that nothing sees."""

    tokens: np.ndarray  # [size] int32
    parents: np.ndarray  # [size] int32: the parent's index; -1 for the root, -2 for padding
    depths: np.ndarray  # [size] int32: 0 for the root (and padding), the node's depth otherwise
    visible: np.ndarray  # [size, size] bool: j is i or one of i's ancestors (`tree_attention_mask`)


def tree_attention_mask(parents: np.ndarray) -> np.ndarray:
    """[n, n] bool: row i sees column j iff j is i or an ancestor of i; parents[i] < i (or negative: none)."""
    size = len(parents)
    visible = np.eye(size, dtype=bool)
    for node in range(size):  # parents come first, so their rows are complete when a child copies them
        if parents[node] >= 0:
            visible[node] |= visible[parents[node]]
    return visible


def verification_tree(tree: DraftTree, bonus: int, size: int) -> VerificationTree:
    """The tree under `bonus` as `size` verification tokens (size >= len(tree.tokens) + 1)."""
    count = len(tree.tokens) + 1
    if size < count:
        raise ValueError(f"a tree of {count - 1} nodes needs {count} verification tokens, got {size}")
    tokens, parents, depths = np.zeros(size, np.int32), np.full(size, -2, np.int32), np.zeros(size, np.int32)
    tokens[0], parents[0] = bonus, -1
    tokens[1:count], parents[1:count], depths[1:count] = tree.tokens, tree.parents + 1, tree.depths
    return VerificationTree(tokens, parents, depths, tree_attention_mask(parents))
