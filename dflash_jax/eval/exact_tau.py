"""Exact greedy acceptance length τ without a KV cache (design §9.1; §9.2 for DDTree).

For one response = prompt (positions 0..n-1) + the target's greedy continuation (n..L-1):
  1. the target runs once over the whole text (features, and its own greedy tokens as a check);
  2. the drafter runs once with an anchor at EVERY position (AnchorGrid stride 1, the training mask): the
     block at anchor p is [token p, mask...] and sees the features of positions < p only, which is exactly
     a verification step whose bonus token sits at p. Its drafts are positions p+1..p+D (top-k log-probs
     kept): slots k = 1..B-1 draft p+k (D = B-1), or for DSpark every slot k drafts p+k+1 (D = B) with the
     Markov bias of the token at p+k, teacher-forced: while the drafts before it are accepted, that token is
     the one greedy drafting fed the bias there (design §18.2); for DFlash2 slot k drafts the selector's pick
     among its candidates after the continuation's token at p+k-1, which while the drafts before it are
     accepted is the token the walk took there (design §18.4);
  3. accepted(p) = how many leading drafts equal the continuation;
  4. the walk starts at p = n (the first generated token is the prefill's bonus) and moves
     p -> p + accepted(p) + 1, recording accepted + 1 per step, like greedy speculative decoding with block
     verification. A step accepts at most what still fits in the continuation together with its bonus
     (accepted <= L-2-p), so every committed token is known; `generate.SpeculativeGenerator` applies the
     same cap and commits exactly these steps.
τ (the headline) is pooled over responses: all committed tokens (accepted drafts plus each step's bonus) over
all verification steps, as vLLM's mean acceptance length and z-lab's benchmark count it; τ per response, the
mean over responses of each response's mean of (accepted + 1), is reported beside it (design §9.1).
DDTree τ walks the same way with accepted(p) = the depth the continuation reaches in that anchor's tree.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dflash_jax.eval import context_bins
from dflash_jax.eval.ddtree import accepted_depth, build_tree, ddtree_defined
from dflash_jax.models.dflash import target_context
from dflash_jax.models.drafter import Drafter
from dflash_jax.ops.anchors import AnchorGrid, DrafterInputs, slot_tokens
from dflash_jax.ops.lm_head import fp32_logits
from dflash_jax.sharding import BATCH_AXES, batch_sharding, replicated
from dflash_jax.runtime import distributed

DEFAULT_BUDGETS = (8, 22)


class Example(NamedTuple):
    prompt_ids: np.ndarray  # [n] int
    continuation_ids: np.ndarray  # [m] int, the target's greedy continuation of the prompt


class DraftScorer:
    """The target over texts and the drafter at every anchor of them, several texts (rows) per jitted forward
    (design §9.5). Texts are grouped by length bucket (padded to a multiple of `length_bucket`); a bucket's
    texts go in as few batches of at most `rows` as hold them, all of one size, so every bucket compiles once
    and the last batch, padded with empty rows, wastes little. The compiled forward is shared by every scorer
    of the same models, settings and shapes, so an evaluation repeated during training compiles once.

    Rows are split over the (data, fsdp) axes of the mesh the target's weights lie on, as the train step splits
    its batch (a batch's rows are rounded up to a multiple of their size); the outputs are gathered onto every
    device, so every process reads every row of the call. rows None: 8 on accelerators, one per device on CPU,
    where more rows per device score fewer texts a second (bench/RESULTS.md, "Evaluation throughput").

    query_chunk_blocks: this forward runs the drafter's XLA attention with this many blocks per query chunk
    (stride 1 puts a block at every position: a text of L tokens is L blocks, scanned 64 at a time);
    None keeps the drafter as it is. top_k: log-probs kept per slot (the largest DDTree budget is enough).
    """

    def __init__(self, target, drafter: Drafter, *, top_k: int, rows: int | None = None,
                 query_chunk_blocks: int | None = 64, row_chunk: int = 256, vocab_chunk: int = 8192,
                 length_bucket: int = 128):
        if query_chunk_blocks is not None:
            drafter = _rechunked(drafter, query_chunk_blocks)
        self.length_bucket = length_bucket
        target_def, self._target_state = nnx.split(target)
        drafter_def, self._drafter_state = nnx.split(drafter)
        self.mesh = weights_mesh(self._target_state)
        self._row_split = 1 if self.mesh is None else int(np.prod([self.mesh.shape[a] for a in BATCH_AXES]))
        if rows is None:
            device = next(iter(jax.tree.leaves(self._target_state)[0].sharding.device_set))
            rows = 1 if device.platform == "cpu" else 8
        self.rows = round_up(rows, self._row_split)
        self._static = (target_def, drafter_def, min(top_k, drafter.config.vocab_size), row_chunk, vocab_chunk,
                        self.mesh)

    def __call__(self, sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One text; see `score`."""
        return self.score([sequence])[0]

    def score(self, sequences: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Texts [L] -> per text, in order: (target greedy token after each position [L], drafted top-k tokens
        and their log-probs [L, D, top_k]: row p, column d-1 is the d-th draft of the block at anchor p, the
        token at p+d; D = the drafter's `draft_length`)."""
        buckets: dict[int, list[int]] = {}
        for index, sequence in enumerate(sequences):
            buckets.setdefault(round_up(len(sequence), self.length_bucket), []).append(index)
        results = [None] * len(sequences)
        for width, indices in buckets.items():
            # Batches of equal size: padding the last one to `rows` would waste up to rows - 1 rows' work.
            batches = -(-len(indices) // self.rows)
            rows = round_up(-(-len(indices) // batches), self._row_split)
            for first in range(0, len(indices), rows):
                batch = indices[first:first + rows]
                # Padding sits after each text (causal, so it changes nothing before) and in the empty rows,
                # whose outputs are never read.
                ids = np.zeros((rows, width), np.int32)
                for row, index in enumerate(batch):
                    ids[row, :len(sequences[index])] = sequences[index]
                scores = _score(*self._static, self._target_state, self._drafter_state, self._put(ids))
                greedy, tokens, log_probs = jax.device_get(scores)
                for row, index in enumerate(batch):
                    length = len(sequences[index])
                    results[index] = greedy[row, :length], tokens[row, :length], log_probs[row, :length]
        return results

    def _put(self, ids: np.ndarray):
        """The batch on the mesh, rows split over (data, fsdp); each process gives its own devices' rows."""
        if self.mesh is None:
            return ids
        return jax.make_array_from_callback(ids.shape, batch_sharding(self.mesh), lambda index: ids[index])


def weights_mesh(state: nnx.State) -> Mesh | None:
    """The mesh a model's weights were placed on (None: a single device)."""
    sharding = jax.tree.leaves(state)[0].sharding
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _score(target_def, drafter_def, top_k, row_chunk, vocab_chunk, mesh, target_state, drafter_state, input_ids):
    if mesh is None:
        return _score_rows(target_def, drafter_def, top_k, row_chunk, vocab_chunk, target_state, drafter_state,
                           input_ids)
    # The activations' sharding constraints read the mesh from the trace context, as in the train step.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        scores = _score_rows(target_def, drafter_def, top_k, row_chunk, vocab_chunk, target_state, drafter_state,
                             input_ids)
    return jax.lax.with_sharding_constraint(scores, replicated(mesh))


def _score_rows(target_def, drafter_def, top_k, row_chunk, vocab_chunk, target_state, drafter_state, input_ids):
    target, drafter = nnx.merge(target_def, target_state), nnx.merge(drafter_def, drafter_state)
    config, (batch, length) = drafter.config, input_ids.shape
    grid = AnchorGrid(length, 1, config.block_size)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    segments = jnp.ones((batch, length), jnp.int32)
    context = target_context(target, input_ids, positions, segments, grid, config, vocab_chunk=vocab_chunk)
    greedy = context.labels[:, :, 0]  # the first draft of the block at anchor p: the target's greedy token after p
    hidden, _ = drafter(context.features, context.block_embeds, DrafterInputs.from_rows(grid, positions, segments))
    first_slot = config.block_size - config.draft_length
    drafted = hidden.reshape(batch, length, config.block_size, -1)[:, :, first_slot:].reshape(-1, hidden.shape[-1])
    selector = drafter.candidate_selector
    if selector is not None:  # DFlash2: one draft per slot, the selector's (no DDTree: top_k is 1)
        predecessors = slot_tokens(input_ids, grid.anchors, config.block_size)[:, :, :-1].reshape(-1)
        candidate_ids, candidate_log_probs = top_k_log_probs(drafted, context.lm_head, selector.top_k, row_chunk)
        tokens = jax.lax.map(lambda rows: selector.best(*rows), (drafted, predecessors, candidate_ids,
                                                                  candidate_log_probs), batch_size=row_chunk)[:, None]
        log_probs = jnp.zeros(tokens.shape, jnp.float32)
    else:
        bias = None
        if drafter.markov_head is not None:  # DSpark: the bias of the text's token at p+k for slot k (design §18.2)
            prev_ids = slot_tokens(input_ids, grid.anchors, config.block_size).reshape(-1)
            bias = (functools.partial(drafter.markov_head.logit_bias, dtype=drafter.dtype), prev_ids)
        tokens, log_probs = top_k_log_probs(drafted, context.lm_head, top_k, row_chunk, bias)
    shape = (batch, length, config.draft_length, top_k)
    return greedy, tokens.reshape(shape), log_probs.reshape(shape)


def _rechunked(drafter: Drafter, query_chunk_blocks: int) -> Drafter:
    """The same weights under a graph whose XLA attention walks `query_chunk_blocks` blocks per chunk."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Drafter(
        drafter.config, rngs=nnx.Rngs(0), dtype=drafter.dtype, attention_impl="xla",
        query_chunk_blocks=query_chunk_blocks)))
    return nnx.merge(graphdef, nnx.state(drafter))


def top_k_log_probs(hidden: jax.Array, lm_head: jax.Array, k: int, row_chunk: int,
                    bias: tuple[Callable[[jax.Array], jax.Array], jax.Array] | None = None):
    """Top-k (token, log-softmax) of hidden @ lm_head per row, row_chunk rows at a time ([rows, V] logits
    would not fit for long texts and large vocabularies). Ties keep the lower token id first.
    bias = (fn, ids [rows]): fn(ids of a chunk's rows) [chunk, V] is added to its logits (DSpark's Markov bias)."""
    rows = hidden.shape[0]
    chunk = min(row_chunk, rows)
    padding = -(-rows // chunk) * chunk - rows
    padded = jnp.pad(hidden, ((0, padding), (0, 0))).reshape(-1, chunk, hidden.shape[1])
    ids = jnp.zeros((rows,), jnp.int32) if bias is None else bias[1]
    ids = jnp.pad(ids, (0, padding)).reshape(-1, chunk)

    def one_chunk(inputs):
        h, chunk_ids = inputs
        logits = fp32_logits(h, lm_head)
        if bias is not None:
            logits = logits + bias[0](chunk_ids)
        values, tokens = jax.lax.top_k(logits, k)  # on the logits, so the first is exactly their argmax
        return tokens.astype(jnp.int32), values - jax.nn.logsumexp(logits, axis=-1, keepdims=True)

    tokens, values = jax.lax.map(one_chunk, (padded, ids))
    return tokens.reshape(-1, k)[:rows], values.reshape(-1, k)[:rows]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def leading_matches(matches: np.ndarray) -> np.ndarray:
    """[P, D] bool -> [P] length of the leading run of True in each row."""
    return np.cumprod(matches, axis=1).sum(axis=1)


def walk(accepted, start: int, end: int) -> list[int]:
    """Accepted drafts of each verification step from the bonus at `start` until position end-1 is
    committed; `accepted(p)` is what the drafter at anchor p gets right, capped so that the accepted drafts
    and the step's bonus stay before `end`."""
    steps, p = [], start
    while p < end - 1:
        taken = min(int(accepted(p)), end - 2 - p)
        steps.append(taken)
        p += taken + 1
    return steps


@dataclasses.dataclass
class ResponseScores:
    block_steps: list[int]  # accepted drafts per verification step (τ entries are these + 1)
    tree_steps: dict[int, list[int]]  # the same for DDTree, per node budget
    slot_matches: np.ndarray  # [D] anchors whose k-th draft is the continuation's token
    slot_count: np.ndarray  # [D] anchors whose k-th draft lies inside the continuation
    slot_run: np.ndarray  # [D] anchors whose drafts 1..k all are
    slot_run_before: np.ndarray  # [D] anchors whose drafts 1..k-1 all are and whose k-th lies inside
    greedy_agreement: tuple[int, int]  # (continuation tokens equal to the target's greedy token, count)
    context_tokens: int  # the prompt's length: the context of the first verification step

    def to_json(self) -> dict:
        return {**{name: getattr(self, name).tolist() for name in _SLOT_COUNTS}, "block_steps": self.block_steps,
                "tree_steps": list(self.tree_steps.items()), "greedy_agreement": list(self.greedy_agreement),
                "context_tokens": self.context_tokens}

    @classmethod
    def from_json(cls, value: dict) -> ResponseScores:
        return cls(block_steps=value["block_steps"], tree_steps={int(b): steps for b, steps in value["tree_steps"]},
                   greedy_agreement=tuple(value["greedy_agreement"]), context_tokens=value["context_tokens"],
                   **{name: np.asarray(value[name], np.int64) for name in _SLOT_COUNTS})


_SLOT_COUNTS = ("slot_matches", "slot_count", "slot_run", "slot_run_before")


def score_responses(scorer: DraftScorer, examples: Sequence[Example], budgets: Sequence[int]
                    ) -> list[ResponseScores]:
    """Each example's verification steps and slot counts; the scorer takes the texts several per forward."""
    sequences = []
    for example in examples:
        prompt, continuation = np.asarray(example.prompt_ids), np.asarray(example.continuation_ids)
        if len(prompt) < 1 or len(continuation) < 1:
            raise ValueError(f"an example needs a prompt and a continuation, got {len(prompt)} and "
                             f"{len(continuation)} tokens")
        sequences.append(np.concatenate([prompt, continuation]).astype(np.int32))
    return [_response_scores(sequence, len(example.prompt_ids), scores, budgets)
            for example, sequence, scores in zip(examples, sequences, scorer.score(sequences))]


def _response_scores(sequence: np.ndarray, start: int, scores: tuple[np.ndarray, np.ndarray, np.ndarray],
                     budgets: Sequence[int]) -> ResponseScores:
    greedy, tokens, log_probs = scores
    end = len(sequence)
    depth = tokens.shape[1]
    anchors = np.arange(start, end - 1)  # every anchor that has at least one slot inside the text
    target_index = anchors[:, None] + np.arange(1, depth + 1)[None, :]
    inside = target_index < end
    matches = inside & (tokens[anchors, :, 0] == sequence[np.minimum(target_index, end - 1)])
    runs = leading_matches(matches)
    run_of_anchor = dict(zip(anchors.tolist(), runs.tolist()))

    def tree_accepted(budget):
        return lambda p: accepted_depth(build_tree(log_probs[p], tokens[p], budget), sequence[p + 1:end])

    return ResponseScores(
        block_steps=walk(run_of_anchor.__getitem__, start, end),
        tree_steps={budget: walk(tree_accepted(budget), start, end) for budget in budgets},
        slot_matches=matches.sum(axis=0),
        slot_count=inside.sum(axis=0),
        slot_run=(runs[:, None] >= np.arange(1, depth + 1)[None, :]).sum(axis=0),
        slot_run_before=(inside & (runs[:, None] >= np.arange(depth)[None, :])).sum(axis=0),
        greedy_agreement=(int(np.sum(greedy[start - 1:end - 1] == sequence[start:end])), end - start),
        context_tokens=start,
    )


def pooled_tau(step_lists: Sequence[Sequence[int]]) -> float:
    """Committed tokens over verification steps, every response's steps pooled: Σ(accepted + 1) / steps."""
    steps = [a for steps in step_lists for a in steps]
    return float(np.mean(np.asarray(steps) + 1)) if steps else float("nan")


def per_response_tau(step_lists: Sequence[Sequence[int]]) -> float:
    """Mean over responses (with at least one step) of each response's mean of accepted + 1."""
    means = [np.mean(np.asarray(steps) + 1) for steps in step_lists if steps]
    return float(np.mean(means)) if means else float("nan")


def summarize(responses: Sequence[ResponseScores], draft_length: int) -> dict:
    """τ (pooled) and τ per response (mean of per-response means), the histogram of accepted drafts per step
    (index a = share of steps accepting exactly a of the draft_length drafts), per-draft acceptance over every
    anchor of the continuations (marginal: the k-th draft right; conditional: right given drafts 1..k-1
    right), DDTree τ per budget (pooled, and per response)."""
    steps = np.concatenate([np.asarray(r.block_steps, np.int64) for r in responses])
    matches, counts, runs, runs_before = (np.sum([getattr(r, f) for r in responses], axis=0)
                                          for f in ("slot_matches", "slot_count", "slot_run", "slot_run_before"))
    agreeing, total = np.sum([r.greedy_agreement for r in responses], axis=0)
    budgets = responses[0].tree_steps.keys() if responses else ()
    return {
        "responses": len(responses),
        "verify_steps": int(steps.size),
        "tau": pooled_tau([r.block_steps for r in responses]),
        "tau_per_response": per_response_tau([r.block_steps for r in responses]),
        "accepted_histogram": (np.bincount(steps, minlength=draft_length + 1)[:draft_length + 1]
                               / max(steps.size, 1)).tolist(),
        "slot_acceptance": (matches / np.maximum(counts, 1)).tolist(),
        "slot_acceptance_conditional": (runs / np.maximum(runs_before, 1)).tolist(),
        "ddtree_tau": {int(b): pooled_tau([r.tree_steps[b] for r in responses]) for b in budgets},
        "ddtree_tau_per_response": {int(b): per_response_tau([r.tree_steps[b] for r in responses]) for b in budgets},
        "greedy_agreement": float(agreeing / max(total, 1)),
    }


def evaluate_drafter(target, drafter: Drafter, examples: Sequence[Example], *,
                     budgets: Sequence[int] = DEFAULT_BUDGETS, rows: int | None = None,
                     query_chunk_blocks: int | None = 64,
                     row_chunk: int = 256, vocab_chunk: int = 8192, across_processes: bool = False,
                     context_edges: Sequence[int] | None = None) -> dict:
    """Exact τ, its histogram, per-draft acceptance and DDTree τ (where defined) of `drafter` on (prompt, greedy
    continuation) examples; see `summarize` for the keys. `greedy_agreement` below 1 means a continuation
    is not exactly the target's greedy one (e.g. read from data made in another precision): τ then
    describes decoding along that text rather than what the generator would commit.

    across_processes: `examples` are this process's share (`process_share`), scored on its own devices, and
    the figures are those of every process's examples in process order, the same on every process (a
    collective: every process calls it). Otherwise every process scores all `examples` (the train-time hook,
    whose target lies on the mesh of every process). context_edges: the figures of each context-length bin
    that holds responses are added under "by_context" (eval/context_bins.py)."""
    if not examples and not across_processes:
        raise ValueError("evaluate_drafter needs at least one (prompt, continuation) example")
    if not ddtree_defined(drafter.config):  # its figures then hold no DDTree τ (an empty dict per budget key)
        budgets = ()
    scorer = DraftScorer(target, drafter, top_k=max(budgets, default=1), rows=rows,
                         query_chunk_blocks=query_chunk_blocks, row_chunk=row_chunk, vocab_chunk=vocab_chunk)
    responses = score_responses(scorer, examples, budgets)
    if across_processes:
        shares = distributed.gather_json([response.to_json() for response in responses])
        responses = [ResponseScores.from_json(value) for share in shares for value in share]
    result = summarize(responses, drafter.config.draft_length)
    if context_edges is not None:
        result["by_context"] = summarize_by_context(responses, context_edges, drafter.config.draft_length)
    return result


def summarize_by_context(responses: Sequence[ResponseScores], edges: Sequence[int], draft_length: int
                         ) -> list[dict]:
    """`summarize` of each context-length bin that holds responses, in bin order, with its label and range."""
    by_bin: dict[int, list[ResponseScores]] = {}
    for response in responses:
        by_bin.setdefault(context_bins.bin_of(response.context_tokens, edges), []).append(response)
    return [{"bin": context_bins.bin_label(index, edges), "min_tokens": 0 if index == 0 else edges[index - 1],
             "max_tokens": edges[index] if index < len(edges) else None, **summarize(members, draft_length)}
            for index, members in sorted(by_bin.items())]


def process_share(items: Sequence) -> list:
    """This process's consecutive share of `items` (the first processes take one more when they do not
    divide evenly); the shares of every process, joined in process order, are `items`."""
    count, index = jax.process_count(), jax.process_index()
    size, extra = divmod(len(items), count)
    first = index * size + min(index, extra)
    return list(items[first:first + size + (index < extra)])
