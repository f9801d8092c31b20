"""Greedy speculative decoding with a decode-cached target (either family) and a DFlash or DSpark drafter
(design §9.3, §18.2).

One loop serves both modes, so their speeds are comparable: with a drafter each step verifies a drafted block
[bonus, d1..d_D] in one target forward and drafts the next (D = B-1, or B for DSpark); without one the block is
just [bonus] (plain greedy decoding, block size 1). The prefill runs the target over the prompt, takes its greedy token as the
first bonus and drafts the first block. Per step, at start = the bonus token's position:
  1. the target extends its KV cache by the block; posterior = its greedy token after each block position;
  2. accepted = the leading drafts equal to the posterior; commit them plus posterior[accepted] (the new
     bonus); cut the target cache back to start + accepted + 1 (`keep_prefix`: K/V columns are simply
     dropped; the hybrid target's verification kept its recurrent state after every block position, and the
     accepted one is picked);
  3. the drafter caches the context K/V of the verified positions (its block K/V are never kept) and drafts
     the block [new bonus, mask...] at the new start, from the context before it (the new bonus's own target
     features do not exist yet): greedy argmax of slots 1..B-1; for DSpark of every slot left to right, each
     with the Markov bias of the token before it (the bonus, then the previous draft; `MarkovHead.greedy_chain`);
     for DFlash2 the candidate selector's walk from the bonus (design §18.4).
Committed tokens never pass `max_new_tokens`: a step accepts at most what still fits with its bonus, and a
stop token is always committed as a bonus (drafts after it do not count), so the output and the acceptance
lengths are exactly those of `exact_tau` on the same greedy continuation.
Batch size 1 (one response at a time), as z-lab's benchmark.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.eval.exact_tau import per_response_tau, pooled_tau, round_up
from dflash_jax.models.dflash import drafter_features
from dflash_jax.models.drafter import DecodeStep, Drafter
from dflash_jax.models.target import NO_SEGMENT
from dflash_jax.ops.anchors import block_token_ids
from dflash_jax.ops.lm_head import fp32_logits, greedy_tokens


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [<= max_new_tokens] generated ids (the prompt excluded), ending at a stop token if any
    acceptance_lengths: list[int]  # tokens committed per verification step: accepted drafts + 1
    decode_seconds: float  # wall time of the verification loop (prefill excluded, as z-lab's TPOT)


def continue_text(target, ids: jax.Array, cache, feature_layer_ids: tuple[int, ...],
                  keep_every_state: bool = False):
    """The target's cached forward over ids [b, t] continuing each row's one document at cache.length;
    keep_every_state: its cache may be cut back to any prefix of ids (`target.keep_prefix`)."""
    positions = jnp.broadcast_to(cache.length + jnp.arange(ids.shape[1]), ids.shape)
    return target(ids, positions, jnp.zeros_like(ids), feature_layer_ids, cache=cache,
                  keep_every_state=keep_every_state)


class SpeculativeGenerator:
    """Jitted prefill and decode step over fixed-size caches: `prefill_len` prompt tokens at most, and
    `capacity` cache columns (at least prompt + max_new_tokens + block size). Fixed shapes mean one compile
    per generator, whatever the prompt."""

    def __init__(self, target, drafter: Drafter | None, *, prefill_len: int, capacity: int):
        self.block_size = drafter.config.block_size if drafter is not None else 1
        self.draft_length = drafter.config.draft_length if drafter is not None else 0  # drafts per step
        self.verify_width = 1 + self.draft_length  # tokens of one verification pass
        if capacity < prefill_len:
            raise ValueError(f"capacity ({capacity}) must be >= prefill_len ({prefill_len})")
        self.prefill_len, self.capacity = prefill_len, capacity
        self._target_def, self._target_state = nnx.split(target)
        self._drafter_def, self._drafter_state = nnx.split(drafter) if drafter is not None else (None, None)
        self._prefill = jax.jit(self._prefill_fn)
        self._step = jax.jit(self._step_fn, donate_argnums=(2, 3))

    # ---- traced functions -------------------------------------------------------------------------------

    def _models(self, target_state, drafter_state):
        target = nnx.merge(self._target_def, target_state)
        drafter = nnx.merge(self._drafter_def, drafter_state) if self._drafter_def is not None else None
        return target, drafter

    def _feature_ids(self, drafter):
        return drafter.config.target_layer_ids if drafter is not None else ()

    def _draft(self, target, drafter, drafter_cache, out, context_start, bonus, anchor):
        """The drafter caches the context of the target's new positions (out, from context_start on) and
        drafts the block after `bonus` [1] at `anchor`: (drafts [1, D], drafter cache). No drafter: none."""
        if drafter is None:
            return jnp.zeros((1, 0), jnp.int32), None
        hidden, drafter_cache = self._draft_hidden(target, drafter, drafter_cache, out, context_start, bonus, anchor)
        if drafter.candidate_selector is not None:  # DFlash2: the selector's walk from the bonus (design §18.4)
            logits = fp32_logits(hidden[:, 1:], target.lm_head_kernel())
            log_probs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # as exact τ's top_k_log_probs
            return drafter.candidate_selector.greedy_walk(hidden[:, 1:], log_probs, bonus), drafter_cache
        if drafter.markov_head is not None:  # DSpark: every slot, left to right (design §18.2)
            return drafter.markov_head.greedy_chain(fp32_logits(hidden, target.lm_head_kernel()), bonus,
                                                    drafter.dtype), drafter_cache
        return greedy_tokens(hidden[:, 1:], target.lm_head_kernel()), drafter_cache

    def _draft_hidden(self, target, drafter, drafter_cache, out, context_start, bonus, anchor):
        """The drafter's final hidden states [1, B, H] of the block after `bonus` at `anchor`, and its cache."""
        block_ids = block_token_ids(bonus[:, None], np.zeros(1, np.int32), self.block_size,
                                    drafter.config.mask_token_id)
        return drafter(drafter_features(out), target.embed(block_ids), DecodeStep(context_start, anchor),
                       drafter_cache)

    def _prefill_fn(self, target_state, drafter_state, prompt, length):
        """prompt: [1, prefill_len] padded; length: its real length. Returns the caches, the first token (the
        first bonus) and the first drafts."""
        target, drafter = self._models(target_state, drafter_state)
        columns = jnp.arange(self.prefill_len)[None]
        # The padding after the prompt is a segment nothing sees, and leaves the hybrid target's recurrent
        # state as the prompt left it; the cache then ends at the prompt.
        segments = jnp.where(columns < length, 0, NO_SEGMENT)
        out = target(prompt, columns, segments, self._feature_ids(drafter), cache=target.init_cache(1, self.capacity))
        cache = out.cache._replace(length=length)
        last = jax.lax.dynamic_index_in_dim(out.hidden, length - 1, axis=1, keepdims=False)
        first = greedy_tokens(last, target.lm_head_kernel())  # [1]
        # The padding's context lands at columns >= length, invisible until the next step overwrites it.
        drafter_cache = drafter.init_cache(1, self.capacity) if drafter is not None else None
        drafts, drafter_cache = self._draft(target, drafter, drafter_cache, out, 0, first, length)
        return cache, drafter_cache, first, drafts

    def _step_fn(self, target_state, drafter_state, cache, drafter_cache, bonus, drafts, limit):
        """One verification step of [bonus, drafts] from the bonus token [1] at position cache.length; at most
        `limit` drafts are accepted. Returns (cache, drafter_cache, posterior [1, 1 + D], accepted, the next step's
        bonus and drafts): the step commits posterior[0, :accepted + 1], the accepted drafts (equal to the
        target's tokens) and the new bonus."""
        target, drafter = self._models(target_state, drafter_state)
        start = cache.length
        block = jnp.concatenate([bonus[:, None], drafts], axis=1)
        out = continue_text(target, block, cache, self._feature_ids(drafter), keep_every_state=True)
        posterior = greedy_tokens(out.hidden, target.lm_head_kernel())
        matches = (block[0, 1:] == posterior[0, :-1]).astype(jnp.int32)
        accepted = jnp.minimum(jnp.sum(jnp.cumprod(matches)), limit)
        cache = target.keep_prefix(out.cache, start + accepted + 1)
        # Positions past the accepted ones carry a rejected draft's context, at columns >= the next anchor.
        next_bonus = jax.lax.dynamic_index_in_dim(posterior, accepted, axis=1, keepdims=False)
        next_drafts, drafter_cache = self._draft(target, drafter, drafter_cache, out, start, next_bonus,
                                                 start + accepted + 1)
        return cache, drafter_cache, posterior, accepted, next_bonus, next_drafts

    # ---- the host loop ----------------------------------------------------------------------------------

    def _verify(self, cache, drafter_cache, bonus, drafts, limit: int):
        """One verification step (see `_step_fn`); the DDTree generator builds its tree here first."""
        return self._step(self._target_state, self._drafter_state, cache, drafter_cache, bonus, drafts,
                          np.int32(limit))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()
                 ) -> Generation:
        """Greedy continuation of prompt_ids: at most max_new_tokens ids, ending at the first stop token."""
        stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        prompt = np.asarray(prompt_ids, np.int32)
        length = len(prompt)
        if not 1 <= length <= self.prefill_len:
            raise ValueError(f"the prompt has {length} tokens; this generator takes 1 to {self.prefill_len}")
        if max_new_tokens < 1 or length + max_new_tokens + self.verify_width > self.capacity:
            raise ValueError(f"max_new_tokens={max_new_tokens} with a {length}-token prompt and {self.verify_width} "
                             f"tokens per verification needs capacity >= "
                             f"{length + max_new_tokens + self.verify_width}, this generator has {self.capacity}")
        padded = np.zeros((1, self.prefill_len), np.int32)
        padded[0, :length] = prompt
        cache, drafter_cache, bonus, drafts = self._prefill(self._target_state, self._drafter_state, padded,
                                                            np.int32(length))
        tokens = [int(bonus[0])]
        acceptance_lengths = []
        began = time.perf_counter()
        while len(tokens) < max_new_tokens and tokens[-1] not in stop_token_ids:
            # The accepted drafts and the new bonus must fit in max_new_tokens.
            limit = min(self.draft_length, max_new_tokens - len(tokens) - 1)
            cache, drafter_cache, committed, accepted, bonus, drafts = self._verify(cache, drafter_cache, bonus,
                                                                                    drafts, limit)
            accepted = int(accepted)  # waits for the step, so the timing is honest
            committed = np.asarray(committed[0])
            stop = next((k for k in range(accepted) if committed[k] in stop_token_ids), None)
            if stop is not None:  # the response ends there: the stop token is this step's bonus, as in exact_tau
                accepted = stop
            tokens.extend(int(t) for t in committed[:accepted + 1])  # ends with the step's bonus
            acceptance_lengths.append(accepted + 1)
        decode_seconds = time.perf_counter() - began
        return Generation(np.asarray(tokens, np.int32), acceptance_lengths, decode_seconds)


def generator_shapes(prompt_lengths: Sequence[int], max_new_tokens: int, block_size: int,
                     bucket: int = 64) -> dict[str, int]:
    """prefill_len and capacity that fit every prompt, rounded up so similar prompt sets share a compile."""
    prefill_len = round_up(max(prompt_lengths), bucket)
    return dict(prefill_len=prefill_len, capacity=round_up(prefill_len + max_new_tokens + block_size, bucket))


def benchmark(plain: SpeculativeGenerator, speculative: SpeculativeGenerator, prompts: Sequence[Sequence[int]],
              max_new_tokens: int, stop_token_ids: Sequence[int] = (), ddtree: SpeculativeGenerator | None = None
              ) -> tuple[dict, list[Generation], list[Generation]]:
    """Plain greedy vs speculative (and, given `ddtree`, DDTree) decoding on the same prompts with the same
    host loop (design §9.3, §9.4).

    Returns (report, plain generations, speculative generations). Report: τ (pooled: committed tokens over
    verification steps, as exact τ's headline) and τ per response (the mean of per-response means), decode
    tokens/s of each decoder (prefill excluded), speedup = mean plain TPOT / mean speculative TPOT (z-lab), how
    many outputs differ from plain greedy (must be 0), and under "ddtree" the same for DDTree decoding. Each
    generator is compiled on a short untimed run first.
    """
    if not prompts:
        raise ValueError("benchmark needs at least one prompt")
    decoders = {"plain": plain, "speculative": speculative, **({"ddtree": ddtree} if ddtree is not None else {})}
    runs = {}
    for name, generator in decoders.items():
        generator.generate(prompts[0], min(max_new_tokens, 2 * speculative.verify_width))  # compile, untimed
        runs[name] = [generator.generate(prompt, max_new_tokens, stop_token_ids) for prompt in prompts]

    def speed(generations: list[Generation]) -> tuple[float, float]:
        decoded = [len(g.tokens) - 1 for g in generations]  # the first token comes from the prefill
        seconds = [g.decode_seconds for g in generations]
        tpot = [s / n for s, n in zip(seconds, decoded) if n > 0]
        return sum(decoded) / max(sum(seconds), 1e-12), float(np.mean(tpot)) if tpot else float("nan")

    speeds = {name: speed(generations) for name, generations in runs.items()}

    def figures(name: str) -> dict:
        steps = [[length - 1 for length in g.acceptance_lengths] for g in runs[name]]
        return {"tau": pooled_tau(steps), "tau_per_response": per_response_tau(steps),
                "speedup": speeds["plain"][1] / speeds[name][1],
                "outputs_differing_from_plain": sum(not np.array_equal(a.tokens, b.tokens)
                                                    for a, b in zip(runs["plain"], runs[name]))}

    report = {"responses": len(prompts), **figures("speculative"),
              "tokens_per_second": {name: rate for name, (rate, _) in speeds.items()}}
    if ddtree is not None:
        report["ddtree"] = {"budget": ddtree.budget, **figures("ddtree")}
    return report, runs["plain"], runs["speculative"]
