"""Continuous batching with the target's decode cache (design §14): prompts in, each one's continuation out.

Prompts are bucketed by length: a bucket holds the prompts of up to W tokens, W a power of two from 128. One
fixed-shape batch of `batch_size` rows decodes them all, its cache of W_max + 2 * max_new_tokens columns
(W_max: the widest bucket present), so each set of widths compiles once. A prompt is left-padded to its W
(the padding a segment of its own, so no text token attends to it and the Gated DeltaNet layers start their
conv and recurrent state fresh at the first text token; positions count from that token), prefilled in a
group of `refill_rows` prompts of one bucket and placed into free rows of the batch (slots.py). The batch
then decodes one token per row per step, every row at the same cache column, in a `lax.while_loop` that
returns to the host once `refill_rows` more rows have produced a stop token or `max_new_tokens` tokens; their
responses are taken and the next prompts (narrow buckets first) refill those rows, so the batch stays full
until the prompts run out. When a refill would leave a row less than max_new_tokens columns, the cache's
columns are first shifted left past the oldest row's prompt (the second max_new_tokens of room makes that
always enough). The target is either model family (`Qwen3`, `Qwen3_5`): both take the same cached
`__call__` (models/target.py).

Greedy decoding takes the argmax of the fp32 logits, as the training labels and the speculative generator
do (ops/lm_head.py `fp32_logits`). Sampling (temperature > 0, optional top-p) draws each row's step-s token
with its own key (the seed's, folded with the row's record index and turn, then with s), so a response
depends on its record alone, not on which rows it shared a batch with or whether the job was resumed.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.eval.generate import round_up
from dflash_jax.ops.lm_head import fp32_logits
from dflash_jax.regeneration import slots
from dflash_jax.sharding import BATCH_AXES, batch_sharding, replicated

PROMPT_BUCKET = 128  # the narrowest prompt bucket; the others double it, so a job compiles a few widths only
REFILL_SHARE = 4  # rows are refilled in groups of a quarter of the batch: one prefill call per group


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


def bucket_width(prompt_length: int) -> int:
    """The prefill width of a prompt's bucket: the smallest power of two >= its length, at least PROMPT_BUCKET."""
    return max(PROMPT_BUCKET, 1 << (prompt_length - 1).bit_length())


def left_padded(prompts: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, positions, segment ids), each [len(prompts), width]: every prompt right-aligned; padding in
    segment 0 at position 0, text in segment 1 at positions 0, 1, ..."""
    lengths = np.asarray([len(p) for p in prompts])
    ids = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
    columns = np.arange(width)[None]
    pad = (width - lengths)[:, None]
    return ids, np.maximum(columns - pad, 0).astype(np.int32), (columns >= pad).astype(np.int32)


def _restrict_top_p(logits: jax.Array, top_p: float) -> jax.Array:
    """logits [b, V] with every token outside each row's nucleus set to -inf (the most likely always stays)."""
    descending = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(descending, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
    kept = jnp.where(before < top_p, descending, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


class Rows(NamedTuple):
    """The batch on the devices between calls: its decode cache and, per row, the response so far."""
    cache: slots.Cache
    tokens: jax.Array  # [b, max_new_tokens] the row's response
    counts: jax.Array  # [b] tokens in it
    last: jax.Array  # [b] the token to feed next
    positions: jax.Array  # [b] its position
    key_data: jax.Array  # [b, words] uint32: the row's sampling key (`jax.random.key_data`)
    active: jax.Array  # [b] bool: the row is still decoding a response


class BatchDecoder:
    """Jitted continuous batching for one target: `decode(prompts, sample_keys)` -> token lists.

    `batch_size` rows, split over the mesh's batch axes (data, fsdp) when a mesh is given, with the target's
    weights where `load_target(mesh=...)` put them. Compiles: a refill per bucket width, and the decode loop
    and the column shift per widest bucket.
    """

    def __init__(self, target: nnx.Module, *, batch_size: int, max_new_tokens: int, stop_token_ids: Sequence[int],
                 sampling: Sampling = Sampling(), mesh: Mesh | None = None):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        shards = 1 if mesh is None else int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))
        if batch_size < 1 or batch_size % shards:
            raise ValueError(f"batch_size ({batch_size}) must be a positive multiple of the mesh's data x fsdp "
                             f"size ({shards}), which the rows are split over")
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.refill_rows = min(batch_size, round_up(-(-batch_size // REFILL_SHARE), shards))
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.sampling, self.mesh = sampling, mesh
        self._key_words = jax.random.key_data(jax.random.key(0)).shape[-1]  # a sampling key's uint32 words
        self._graphdef, self._state = nnx.split(target)
        self._empty = jax.jit(self._empty_fn, static_argnums=(1, 2))
        self._refill = jax.jit(self._refill_fn, donate_argnums=(1,))
        self._run = jax.jit(self._run_fn, donate_argnums=(1,))
        self._shift = jax.jit(self._shift_fn, donate_argnums=(1,))

    def decode(self, prompts: Sequence[Sequence[int]], sample_keys: Sequence[tuple[int, ...]]) -> list[list[int]]:
        """Each prompt's continuation: at most max_new_tokens ids, ending at (and including) the first stop
        token if one came. Row r samples with the seed's key folded with the integers sample_keys[r] (e.g.
        record index and turn); greedy decoding ignores them."""
        results: list[list[int]] = [[] for _ in prompts]
        if not prompts:
            return results
        batch, limit, group = self.batch_size, self.max_new_tokens, self.refill_rows
        # Narrow buckets first: the rows one frees are refilled from the next, so the batch never drains
        # between buckets.
        pending = collections.deque(sorted(((bucket_width(len(p)), i, p, tuple(k))
                                            for i, (p, k) in enumerate(zip(prompts, sample_keys))),
                                           key=lambda item: item[:2]))
        widest = pending[-1][0]
        capacity = widest + 2 * limit
        state = self._empty(self._state, widest, capacity)
        holder: list[int | None] = [None] * batch  # the result index each row decodes
        first_column = [0] * batch  # where each row's prompt begins in the cache
        length = widest  # the cache's current column (state.cache.length)
        while True:
            active, counts = jax.device_get((state.active, state.counts))
            finished = [row for row in range(batch) if holder[row] is not None and not active[row]]
            if finished:
                tokens = jax.device_get(state.tokens[np.asarray(finished)])
                for row, row_tokens in zip(finished, tokens):
                    results[holder[row]] = row_tokens[:counts[row]].tolist()
                    holder[row] = None
            free = [row for row in range(batch) if holder[row] is None]
            if pending and free and length + limit > capacity:  # make room: drop columns no row needs
                busy = [first_column[row] for row in range(batch) if holder[row] is not None]
                shift = min(busy + [length - widest])  # the widest prompt must still fit before the column
                state = self._shift(self._state, state, jnp.int32(shift))
                length -= shift
                first_column = [column - shift for column in first_column]
            while pending and free:
                width = pending[0][0]
                taken = []
                while pending and pending[0][0] == width and len(taken) < min(group, len(free)):
                    taken.append(pending.popleft())
                rows, free = free[:len(taken)], free[len(taken):]
                state = self._refill_rows(state, rows, taken, width)
                for row, (_, index, _, _) in zip(rows, taken):
                    holder[row], first_column[row] = index, length - width
            if all(index is None for index in holder):
                return results
            wanted = min(group, len(pending)) if pending else batch
            state = self._run(self._state, state, jnp.int32(wanted), jnp.int32(capacity))
            length = int(state.cache.length)

    def _refill_rows(self, state: Rows, rows: list[int], taken: list, width: int) -> Rows:
        """`state` with `rows` holding the prefilled prompts of `taken`; the group is padded to refill_rows
        with copies of its first prompt, written to row index batch_size (dropped)."""
        padding = self.refill_rows - len(taken)
        prompts = [prompt for _, _, prompt, _ in taken]
        keys = [key for _, _, _, key in taken]
        arrays = left_padded(prompts + prompts[:1] * padding, width)
        paths = np.asarray(keys + keys[:1] * padding, np.uint32).reshape(self.refill_rows, len(keys[0]))
        rows = np.asarray(rows + [self.batch_size] * padding, np.int32)
        if self.mesh is not None:
            arrays = jax.device_put(arrays, batch_sharding(self.mesh))
            paths = jax.device_put(paths, batch_sharding(self.mesh))
            rows = jax.device_put(rows, replicated(self.mesh))
        return self._refill(self._state, state, rows, *arrays, paths)

    def _row_key(self, path: jax.Array) -> jax.Array:
        key = jax.random.key(self.sampling.seed)
        for i in range(path.shape[0]):
            key = jax.random.fold_in(key, path[i])
        return key

    # ---- traced ---------------------------------------------------------------------------------------------

    def _rows_on_mesh(self, target, state: Rows) -> Rows:
        """`state` with its rows split over the mesh's batch axes, as the prompts are (none without a mesh)."""
        if self.mesh is None:
            return state

        def split(array, axis):
            spec = [None] * array.ndim
            spec[axis] = BATCH_AXES
            return jax.lax.with_sharding_constraint(array, NamedSharding(self.mesh, PartitionSpec(*spec)))

        cache = slots.map_rows(target, state.cache, lambda array: split(array, 1))
        cache = cache._replace(segment_ids=split(cache.segment_ids, 0))
        return state._replace(cache=cache, **{name: split(getattr(state, name), 0)
                                              for name in Rows._fields if name != "cache"})

    def _empty_fn(self, state, widest: int, capacity: int) -> Rows:
        """A batch with no row decoding, its cache at column `widest`: room before it for any prompt."""
        target = nnx.merge(self._graphdef, state)
        batch = self.batch_size
        zeros = jnp.zeros((batch,), jnp.int32)
        cache = target.init_cache(batch, capacity)._replace(length=jnp.int32(widest))
        return self._rows_on_mesh(target, Rows(
            cache, jnp.zeros((batch, self.max_new_tokens), jnp.int32), zeros, zeros, zeros,
            jnp.zeros((batch, self._key_words), jnp.uint32), jnp.zeros((batch,), bool)))

    def _next_tokens(self, target, hidden: jax.Array, key_data: jax.Array, steps: jax.Array) -> jax.Array:
        """[b] next token from the final-normed hidden states [b, H] of each row's last position; row r
        samples its step-steps[r] token."""
        logits = fp32_logits(hidden, target.lm_head_kernel())
        if self.sampling.temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits / self.sampling.temperature
        if self.sampling.top_p < 1:
            logits = _restrict_top_p(logits, self.sampling.top_p)
        step_keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data), steps)
        return jax.vmap(jax.random.categorical)(step_keys, logits).astype(jnp.int32)

    def _finished(self, tokens: jax.Array, counts: jax.Array) -> jax.Array:
        stops = jnp.asarray(self.stop_token_ids or (-1,), jnp.int32)
        return jnp.isin(tokens, stops) | (counts >= self.max_new_tokens)

    def _refill_fn(self, state, rows_state: Rows, rows, ids, positions, segment_ids, paths) -> Rows:
        """Prefill the prompts [k, W] and place them in `rows` [k] with their first token (design §14)."""
        target = nnx.merge(self._graphdef, state)
        group, width = ids.shape
        out = target(ids, positions, segment_ids, cache=target.init_cache(group, width))
        key_data = jax.random.key_data(jax.vmap(self._row_key)(paths))
        first = self._next_tokens(target, out.hidden[:, -1], key_data, jnp.zeros((group,), jnp.int32))
        ones = jnp.ones((group,), jnp.int32)

        def put(array, new):
            return array.at[rows].set(new, mode="drop")

        return self._rows_on_mesh(target, Rows(
            slots.place_rows(target, rows_state.cache, out.cache, rows),
            put(rows_state.tokens, jnp.zeros((group, self.max_new_tokens), jnp.int32).at[:, 0].set(first)),
            put(rows_state.counts, ones), put(rows_state.last, first), put(rows_state.positions, positions[:, -1] + 1),
            put(rows_state.key_data, key_data), put(rows_state.active, ~self._finished(first, ones))))

    def _run_fn(self, state, rows_state: Rows, wanted, capacity) -> Rows:
        """Decode until `wanted` more rows have finished (or every row has), one token per row per step."""
        target = nnx.merge(self._graphdef, state)
        batch = self.batch_size
        idle_target = jnp.minimum(jnp.sum(~rows_state.active) + wanted, batch)

        def unfinished(s: Rows):
            return (s.cache.length < capacity) & (jnp.sum(~s.active) < idle_target)

        def decode_step(s: Rows):
            out = target(s.last[:, None], s.positions[:, None], jnp.ones((batch, 1), jnp.int32), cache=s.cache)
            token = self._next_tokens(target, out.hidden[:, 0], s.key_data, s.counts)
            column = jnp.where(s.active, s.counts, self.max_new_tokens)  # finished rows write nothing
            tokens = s.tokens.at[jnp.arange(batch), column].set(token, mode="drop")
            counts = s.counts + s.active
            return s._replace(cache=out.cache, tokens=tokens, counts=counts, last=token,
                              positions=s.positions + s.active,
                              active=s.active & ~self._finished(token, counts))

        return self._rows_on_mesh(target, jax.lax.while_loop(unfinished, decode_step, rows_state))

    def _shift_fn(self, state, rows_state: Rows, shift) -> Rows:
        target = nnx.merge(self._graphdef, state)
        return self._rows_on_mesh(target, rows_state._replace(cache=slots.shift_left(target, rows_state.cache, shift)))
