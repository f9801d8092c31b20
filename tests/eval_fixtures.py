"""The small drafter the generation and exact-τ tests share, a tiny target with greedy texts of it, and a brief
training of the drafter on them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dflash_jax.eval.exact_tau import Example
from dflash_jax.eval.generate import SpeculativeGenerator
from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.ops.anchors import AnchorGrid, DrafterInputs, block_token_ids
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


def train_briefly(target, drafter: Drafter, examples, steps: int, new_tokens: int, length: int = 48) -> Drafter:
    """A few Adam steps of block cross-entropy on the examples' continuations (prompt_ids, continuation_ids;
    stride-1 anchors), enough for partly right drafts. Deliberately independent of the train package."""
    config = drafter.config
    grid = AnchorGrid(length, 1, BLOCK)
    texts = np.stack([np.pad(np.concatenate([e.prompt_ids, e.continuation_ids]), (0, length))[:length]
                      for e in examples]).astype(np.int32)
    starts = np.asarray([len(e.prompt_ids) for e in examples])[:, None, None]
    ends = starts + new_tokens
    positions = jnp.broadcast_to(jnp.arange(length), texts.shape)
    segments = jnp.ones(texts.shape, jnp.int32)
    features = target(jnp.asarray(texts), positions, segments, config.target_layer_ids).features
    features = features.reshape(len(texts), length, -1)
    embeds = target.embed(block_token_ids(texts, grid.anchors, BLOCK, config.mask_token_id))
    inputs = DrafterInputs.from_rows(grid, positions, segments)
    slot_index = grid.anchors[:, None] + np.arange(BLOCK)[None, :]
    labels = jnp.asarray(texts[:, np.minimum(slot_index, length - 1)])
    weights = ((grid.anchors[None, :, None] >= starts) & (slot_index[None] < ends) & (slot_index[None] > grid.anchors[
        None, :, None])).astype(np.float32)
    lm_head = target.lm_head_kernel()
    optimizer = nnx.Optimizer(drafter, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(drafter, optimizer):
        def loss_fn(model):
            hidden, _ = model(features, embeds, inputs)
            logits = hidden.reshape(len(texts), length, BLOCK, -1) @ lm_head
            return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels) * weights) / weights.sum()

        loss, grads = nnx.value_and_grad(loss_fn)(drafter)
        optimizer.update(drafter, grads)
        return loss

    for _ in range(steps):
        step(drafter, optimizer)
    return drafter
