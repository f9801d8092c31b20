"""The frozen LM head on hidden states without [rows, V] fp32 logits for all rows at once: the target's greedy
tokens, the training labels among them (design §6).

Every greedy decision (training labels, exact τ, the speculative generator) accumulates the logits in fp32,
so they agree on near-ties in bf16.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dflash_jax.sharding import LM_HEAD, ROWS, ROWS_EMBED, ROWS_VOCAB, constrain, logical_spec, spec_axes


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

    def logits_of(block):
        return constrain(jnp.dot(hidden, block.astype(hidden.dtype), preferred_element_type=jnp.float32), ROWS_VOCAB)

    def body(carry, i):
        return best_in(logits_of(chunk_of(i)), i * chunk, *carry), None

    mesh = jax.sharding.get_abstract_mesh()
    vocab_axes = () if mesh.empty else spec_axes(logical_spec(kernel.shape, LM_HEAD, dict(mesh.shape))[1])
    if math.prod(mesh.shape[axis] for axis in vocab_axes) > 1:
        # The vocabulary is split over `tensor`: slicing it at the loop's traced offset would gather the whole head
        # on every trip. The chunks as [n, H, chunk], each split as the head is, are taken where they lie.
        blocks = kernel[:, :num_full * chunk].reshape(kernel.shape[0], num_full, chunk).transpose(1, 0, 2)
        blocks = constrain(blocks, (None, *LM_HEAD))

        def chunk_of(i):
            return blocks[i]
    else:  # each device holds whole columns: a slice is local, and no rearranged copy of the head is made

        def chunk_of(i):
            return jax.lax.dynamic_slice_in_dim(kernel, i * chunk, chunk, axis=1)

    init = (jnp.full(hidden.shape[:-1], -jnp.inf, jnp.float32), jnp.zeros(hidden.shape[:-1], jnp.int32))
    (best_value, best_index), _ = jax.lax.scan(body, init, jnp.arange(num_full, dtype=jnp.int32))
    if vocab > num_full * chunk:  # the last, shorter chunk
        best_value, best_index = best_in(logits_of(kernel[:, num_full * chunk:]), num_full * chunk, best_value,
                                         best_index)
    return constrain(best_index, ROWS)
