"""The small drafter the generation and exact-τ tests share, and a tiny target with greedy texts of it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.eval.exact_tau import Example
from dflash_jax.eval.generate import SpeculativeGenerator
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.weights.targets import load_target
from tests.hf_fixtures import qwen3_config, save_qwen3


VOCAB, BLOCK = 96, 4


def drafter_config() -> DrafterConfig:
    return DrafterConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=5, block_size=BLOCK,
                         target_layer_ids=(0, 2), num_target_layers=3, mask_token_id=VOCAB - 1, vocab_size=VOCAB,
                         max_position_embeddings=256)


def target_and_greedy_examples(directory, new_tokens: int):
    """A tiny random Qwen3 target (saved in `directory`), its plain greedy generator, and 8 random prompts of 3-12
    tokens with their greedy continuations of `new_tokens` tokens."""
    save_qwen3(directory, qwen3_config(vocab_size=VOCAB), seed=5)
    target = load_target(directory, param_dtype=jnp.float32)[0]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).astype(np.int32) for n in rng.integers(3, 13, 8)]
    plain = SpeculativeGenerator(target, None, prefill_len=16, capacity=64)
    return target, plain, prompts, [Example(p, plain.generate(p, new_tokens).tokens) for p in prompts]
