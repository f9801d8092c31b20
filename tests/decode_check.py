"""A target's decode cache against its uncached forward: batched prompts of different lengths, left-padded
into one prefill, then calls of 1 and 3 tokens; every call's logits must equal the full forward's. Also the
tiny random hybrid target the speculative and DDTree decoding tests share."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3_5, Qwen3_5Config

CALLS = (1, 3, 1, 1, 2, 1)  # tokens per decode call: single tokens and short blocks


@nnx.jit
def _full_logits(model, ids, positions, segments):
    return model.logits(model(ids, positions, segments).hidden)


@nnx.jit
def _cached_logits(model, ids, positions, segments, cache):
    out = model(ids, positions, segments, cache=cache)
    return model.logits(out.hidden), out.cache


def left_padded(prompts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, positions, segments) [b, P]: each prompt right-aligned; padding is segment 0, text segment 1."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
    pad = width - np.asarray([len(p) for p in prompts])[:, None]
    columns = np.arange(width)[None]
    return ids, np.maximum(columns - pad, 0).astype(np.int32), (columns >= pad).astype(np.int32)


def max_relative_error_of_cached_logits(model, vocab: int, prompt_lengths: tuple[int, ...], seed: int = 0) -> float:
    """max over calls and rows of max|cached − full| / max|full| (fp32 model expected)."""
    rng = np.random.default_rng(seed)
    total = sum(CALLS)
    texts = [rng.integers(0, vocab, n + total).astype(np.int32) for n in prompt_lengths]
    prompts = [text[:n] for text, n in zip(texts, prompt_lengths)]

    width = max(prompt_lengths) + total  # one uncached forward over every whole text, right-padded
    full_ids = np.zeros((len(texts), width), np.int32)
    for row, text in enumerate(texts):
        full_ids[row, :len(text)] = text
    full = np.asarray(_full_logits(model, full_ids, np.broadcast_to(np.arange(width), full_ids.shape),
                                   np.ones_like(full_ids)))

    ids, positions, segments = left_padded(prompts)
    cache = model.init_cache(len(prompts), ids.shape[1] + total, jnp.float32)
    logits, cache = _cached_logits(model, ids, positions, segments, cache)
    errors = [_error(full[row, :n], np.asarray(logits)[row, -n:]) for row, n in enumerate(prompt_lengths)]
    done = 0
    for count in CALLS:
        chunk = np.stack([text[n + done:n + done + count] for text, n in zip(texts, prompt_lengths)])
        chunk_positions = np.asarray(prompt_lengths)[:, None] + done + np.arange(count)[None]
        logits, cache = _cached_logits(model, chunk, chunk_positions.astype(np.int32), np.ones_like(chunk), cache)
        for row, n in enumerate(prompt_lengths):
            errors.append(_error(full[row, n + done:n + done + count], np.asarray(logits)[row]))
        done += count
    assert int(cache.length) == ids.shape[1] + total
    return max(errors)


def _error(expected: np.ndarray, actual: np.ndarray) -> float:
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


@functools.cache  # built once per test process (its random init is slow eagerly); no test changes it
def tiny_hybrid_target(vocab: int, seed: int = 3) -> Qwen3_5:
    """A random fp32 Qwen3.5 target of two periods of [Gated DeltaNet, gated attention], built in NNX."""
    return nnx.jit(lambda: _hybrid(vocab, seed))()


def _hybrid(vocab: int, seed: int) -> Qwen3_5:
    return Qwen3_5(Qwen3_5Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 layer_types=(LINEAR_ATTENTION, FULL_ATTENTION) * 2, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                 max_position_embeddings=256), rngs=nnx.Rngs(seed))


def tiny_drafter(vocab: int, block_size: int) -> Drafter:
    """A random one-layer drafter for the 4-layer tiny targets (hidden 64, features after layers 0 and 3)."""
    return Drafter(DrafterConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                                 layer_types=("full_attention",), block_size=block_size, target_layer_ids=(0, 3),
                                 num_target_layers=4, mask_token_id=vocab - 1, vocab_size=vocab,
                                 max_position_embeddings=256), rngs=nnx.Rngs(0))
