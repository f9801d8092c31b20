"""Batched decoding with the target's decode cache (design §14): a batch of prompts in, each one's
continuation out.

Prompts of different lengths are left-padded into one [b, P] prefill: the padding is a segment of its own,
so no text token attends to it and the Gated DeltaNet layers start their conv and recurrent state fresh at
the first text token; positions count from that token. Then one token per row per step, every row at the
same cache column, in a `lax.while_loop` that stops when every row has produced a stop token or
`max_new_tokens` tokens. The target is either model family (`Qwen3`, `Qwen3_5`): both take the same cached
`__call__` (models/target.py).

Greedy decoding takes the argmax of the fp32 logits, as the training labels and the speculative generator
do (ops/lm_head.py `fp32_logits`). Sampling (temperature > 0, optional top-p) draws each row's step-s token
with its own key (the seed's, folded with the row's record index and turn, then with s), so a response
depends on its record alone, not on which batch it landed in or whether the job was resumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.eval.generate import round_up
from dflash_jax.ops.lm_head import fp32_logits
from dflash_jax.sharding import batch_sharding

PROMPT_BUCKET = 128  # prefill widths are multiples of this, so prompt sets of similar length share a compile


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


class BatchDecoder:
    """Jitted batched decoding for one target: `decode(prompts, record_indices)` -> token lists.

    Rows are split over the mesh's batch axes (data, fsdp) when a mesh is given, with the target's weights
    where `load_target(mesh=...)` put them. One compile per (batch size, padded prompt width).
    """

    def __init__(self, target: nnx.Module, *, max_new_tokens: int, stop_token_ids: Sequence[int],
                 sampling: Sampling = Sampling(), mesh: Mesh | None = None):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.sampling, self.mesh = sampling, mesh
        self._graphdef, self._state = nnx.split(target)
        self._decode = jax.jit(self._decode_fn)

    def decode(self, prompts: Sequence[Sequence[int]], sample_keys: Sequence[tuple[int, ...]]) -> list[list[int]]:
        """Each prompt's continuation: at most max_new_tokens ids, ending at (and including) the first stop
        token if one came. Row r samples with the seed's key folded with the integers sample_keys[r] (e.g.
        record index and turn); greedy decoding ignores them."""
        width = round_up(max(len(p) for p in prompts), PROMPT_BUCKET)
        arrays = left_padded(prompts, width)
        keys = jax.vmap(self._row_key)(jnp.asarray(sample_keys, jnp.uint32))
        if self.mesh is not None:
            arrays = jax.device_put(arrays, batch_sharding(self.mesh))
            keys = jax.device_put(keys, batch_sharding(self.mesh, ndim=1))
        tokens, counts = jax.device_get(self._decode(self._state, *arrays, keys))
        return [row[:count].tolist() for row, count in zip(tokens, counts)]

    def _row_key(self, path: jax.Array) -> jax.Array:
        key = jax.random.key(self.sampling.seed)
        for i in range(path.shape[0]):
            key = jax.random.fold_in(key, path[i])
        return key

    # ---- traced ---------------------------------------------------------------------------------------------

    def _next_tokens(self, target, hidden: jax.Array, keys: jax.Array, step: jax.Array) -> jax.Array:
        """[b] next token from the final-normed hidden states [b, H] of each row's last position."""
        logits = fp32_logits(hidden, target.lm_head_kernel())
        if self.sampling.temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits / self.sampling.temperature
        if self.sampling.top_p < 1:
            logits = _restrict_top_p(logits, self.sampling.top_p)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
        return jax.vmap(jax.random.categorical)(step_keys, logits).astype(jnp.int32)

    def _decode_fn(self, state, ids, positions, segment_ids, keys):
        target = nnx.merge(self._graphdef, state)
        batch, width = ids.shape
        limit = self.max_new_tokens
        stops = jnp.asarray(self.stop_token_ids or (-1,), jnp.int32)
        out = target(ids, positions, segment_ids, cache=target.init_cache(batch, width + limit))
        first = self._next_tokens(target, out.hidden[:, -1], keys, jnp.int32(0))
        tokens = jnp.zeros((batch, limit), jnp.int32).at[:, 0].set(first)
        counts = jnp.where(jnp.isin(first, stops), 1, limit)  # tokens kept per row, a stop token included
        next_position = positions[:, -1] + 1

        def unfinished(carry):
            step, _, _, counts, _ = carry
            return (step < limit) & jnp.any(counts > step)

        def decode_step(carry):
            step, cache, tokens, counts, last = carry
            out = target(last[:, None], (next_position + step - 1)[:, None], jnp.ones((batch, 1), jnp.int32),
                         cache=cache)
            token = self._next_tokens(target, out.hidden[:, 0], keys, step)
            tokens = tokens.at[:, step].set(token)
            counts = jnp.where((counts == limit) & jnp.isin(token, stops), step + 1, counts)
            return step + 1, out.cache, tokens, counts, token

        carry = (jnp.int32(1), out.cache, tokens, counts, first)
        _, _, tokens, counts, _ = jax.lax.while_loop(unfinished, decode_step, carry)
        return tokens, counts
