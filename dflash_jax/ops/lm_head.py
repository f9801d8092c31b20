"""The frozen LM head on hidden states without [rows, V] fp32 logits for all rows at once: the target's greedy
tokens, the training labels among them (design §6).

Every greedy decision (training labels, exact τ, the speculative generator) accumulates the logits in fp32,
so they agree on near-ties in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.sharding import ROWS, ROWS_EMBED, ROWS_VOCAB, constrain


def fp32_logits(hidden: jax.Array, lm_head_kernel: jax.Array) -> jax.Array:
    """hidden @ lm_head with fp32 accumulation ([..., H] -> [..., V])."""
    return jnp.dot(hidden, lm_head_kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)


def greedy_tokens(hidden: jax.Array, lm_head_kernel: jax.Array) -> jax.Array:
    return jnp.argmax(fp32_logits(hidden, lm_head_kernel), axis=-1).astype(jnp.int32)


def greedy_labels(hidden: jax.Array, lm_head_kernel: jax.Array, vocab_chunk: int) -> jax.Array:
    """argmax_v (hidden @ lm_head_kernel)[..., v], walking the vocabulary in chunks of `vocab_chunk`.

    hidden: [b, R, H] (the target's final-normed hidden states); lm_head_kernel: [H, V]. Ties resolve to the
    lowest id, as a plain argmax does. Peak memory is [b, R, vocab_chunk] logits, rows split over the batch
    axes and the chunk over `tensor` under a mesh.
    """
    hidden = constrain(jax.lax.stop_gradient(hidden), ROWS_EMBED)
    kernel = jax.lax.stop_gradient(lm_head_kernel)
    vocab = kernel.shape[1]
    chunk = min(vocab_chunk, vocab)
    num_full = vocab // chunk

    def best_in(logits: jax.Array, offset, best_value, best_index):
        local_index = jnp.argmax(logits, axis=-1)
        local_value = jnp.take_along_axis(logits, local_index[..., None], axis=-1)[..., 0]
        better = local_value > best_value  # strict: an earlier chunk keeps ties
        return (jnp.where(better, local_value, best_value),
                jnp.where(better, local_index.astype(jnp.int32) + offset, best_index))

    def logits_of(start, size):
        block = jax.lax.dynamic_slice_in_dim(kernel, start, size, axis=1)
        return constrain(jnp.dot(hidden, block.astype(hidden.dtype), preferred_element_type=jnp.float32), ROWS_VOCAB)

    def body(carry, i):
        offset = i * chunk
        return best_in(logits_of(offset, chunk), offset, *carry), None

    init = (jnp.full(hidden.shape[:-1], -jnp.inf, jnp.float32), jnp.zeros(hidden.shape[:-1], jnp.int32))
    (best_value, best_index), _ = jax.lax.scan(body, init, jnp.arange(num_full, dtype=jnp.int32))
    remainder = vocab - num_full * chunk
    if remainder:
        offset = num_full * chunk
        best_value, best_index = best_in(logits_of(offset, remainder), offset, best_value, best_index)
    return constrain(best_index, ROWS)
