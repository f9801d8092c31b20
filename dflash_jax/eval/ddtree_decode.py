"""Lossless greedy DDTree decoding (design §9.4): the speculative generator with a draft tree per step.

Each step, from one drafter pass (the block after the bonus token, as in `generate`):
  1. the top-k tokens and log-probs of every draft slot give the DDTree (`ddtree.build_tree`, best-first by
     accumulated path log-prob up to `budget` nodes), laid out under the bonus as 1 + budget tokens
     (`ddtree.verification_tree`; built on the host, like the reference implementation's tree);
  2. the target verifies the whole tree in one cached pass: node i at position start + depth(i), seeing the
     cached context and its own ancestors (the tree attention mask, `target.AttentionCache.tree`);
  3. the walk follows the target's greedy token down the tree from the root: accepted = the depth reached;
     the step commits the target's token at each node of that path, so every committed token is the target's
     greedy token after the committed text before it (lossless: the output is plain greedy decoding);
  4. the path's K/V move to the columns after the bonus (`keep_path`; the hybrid target's Gated DeltaNet
     layers, whose every tree token followed its own root path, keep the accepted node's state and conv
     window), the drafter caches the context features of the path, and drafts the next block.
The accepted depths are those of the offline DDTree τ (`exact_tau`) on the same continuation, which this
decoder therefore proves. Both target families.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.eval.ddtree import build_tree, ddtree_defined, verification_tree
from dflash_jax.eval.exact_tau import top_k_log_probs
from dflash_jax.eval.generate import SpeculativeGenerator
from dflash_jax.models.drafter import Drafter
from dflash_jax.ops.lm_head import greedy_tokens


class DDTreeGenerator(SpeculativeGenerator):
    """Greedy decoding that verifies a DDTree of `budget` nodes per step; shapes as `SpeculativeGenerator`
    (capacity >= prompt + max_new_tokens + 1 + budget)."""

    def __init__(self, target, drafter: Drafter, *, budget: int, prefill_len: int, capacity: int):
        if budget < 1:
            raise ValueError(f"the DDTree node budget must be >= 1, got {budget}")
        if not ddtree_defined(drafter.config):
            raise ValueError(f"DDTree is not defined for a {drafter.config.method!r} drafter (design §18.2)")
        self.budget = budget
        self.top_k = min(budget, drafter.config.vocab_size)
        super().__init__(target, drafter, prefill_len=prefill_len, capacity=capacity)
        self.verify_width = 1 + budget

    # ---- traced functions -------------------------------------------------------------------------------

    def _draft(self, target, drafter, drafter_cache, out, context_start, bonus, anchor):
        """As `SpeculativeGenerator._draft`, but the drafts are each slot's top-k (tokens, log-probs), each
        [1, B-1, k], as the offline DDTree τ takes them."""
        hidden, drafter_cache = self._draft_hidden(target, drafter, drafter_cache, out, context_start, bonus, anchor)
        tokens, log_probs = top_k_log_probs(hidden[0, 1:], target.lm_head_kernel(), self.top_k, row_chunk=64)
        return (tokens[None], log_probs[None]), drafter_cache

    def _step_fn(self, target_state, drafter_state, cache, drafter_cache, tree_tokens, parents, depths, visible,
                 limit):
        """Verify the tree (tokens, parents, depths [1 + budget], visible [1 + budget, 1 + budget]) whose root
        is the bonus at position cache.length; accept at most `limit` nodes along its path. Returns (cache,
        drafter_cache, committed [1, 1 + budget]: the target's tokens along the path, then padding, accepted,
        the next bonus, the next drafts)."""
        target, drafter = self._models(target_state, drafter_state)
        start = cache.length
        out = target(tree_tokens[None], (start + depths)[None], jnp.zeros((1, self.verify_width), jnp.int32),
                     self._feature_ids(drafter), cache=cache, tree=visible[None])
        posterior = greedy_tokens(out.hidden, target.lm_head_kernel())[0]  # [1 + budget]

        path = jnp.zeros((self.verify_width,), jnp.int32)  # path[d]: the node at depth d; the root first
        node, accepted = jnp.int32(0), jnp.int32(0)
        for depth in range(1, self.draft_length + 1):
            child = (parents == node) & (tree_tokens == posterior[node])  # at most one: siblings differ
            found = jnp.any(child) & (depth <= limit) & (accepted == depth - 1)
            node = jnp.where(found, jnp.argmax(child).astype(jnp.int32), node)
            accepted = accepted + found.astype(jnp.int32)
            path = path.at[depth].set(jnp.where(found, node, 0))
        cache = target.keep_path(out.cache, start, path, start + accepted + 1)
        committed = jnp.take(posterior, path)[None]
        next_bonus = committed[:, accepted]
        on_path = out._replace(features=jnp.take(out.features, path, axis=1))
        next_drafts, drafter_cache = self._draft(target, drafter, drafter_cache, on_path, start, next_bonus,
                                                 start + accepted + 1)
        return cache, drafter_cache, committed, accepted, next_bonus, next_drafts

    # ---- the host loop ----------------------------------------------------------------------------------

    def _verify(self, cache, drafter_cache, bonus, drafts, limit: int):
        tokens, log_probs = (np.asarray(x[0]) for x in drafts)
        tree = verification_tree(build_tree(log_probs, tokens, self.budget), int(bonus[0]), self.verify_width)
        return self._step(self._target_state, self._drafter_state, cache, drafter_cache, tree.tokens, tree.parents,
                          tree.depths, tree.visible, np.int32(limit))
