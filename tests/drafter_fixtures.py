"""The tiny drafter config, random reference-layout weights and packed rows the drafter, export and attention
tests share."""

from __future__ import annotations

import numpy as np
from flax import nnx

from dflash_jax.models.drafter import DrafterConfig, default_target_layer_ids
from dflash_jax.ops.anchors import DrafterInputs
from dflash_jax.weights.drafter_files import zlab_config

from tests.torch_reference import ReferenceDrafter


SEQ_LEN, BLOCK, HIDDEN, VOCAB, MASK_ID, PAD = 24, 4, 32, 50, 49, -1

FULL, SLIDING = "full_attention", "sliding_attention"
CONFIGS = {"all_full": ((FULL, FULL), None), "sliding_full": ((SLIDING, FULL), 5)}  # layer types, window


def make_config(layer_types=(FULL, FULL), sliding_window=None, **overrides) -> DrafterConfig:
    fields = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=len(layer_types),
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                  layer_types=layer_types, sliding_window=sliding_window, block_size=BLOCK,
                  target_layer_ids=default_target_layer_ids(12, 3), num_target_layers=12, mask_token_id=MASK_ID,
                  vocab_size=VOCAB, max_position_embeddings=256)
    return DrafterConfig(**(fields | overrides))


def random_weights(config: DrafterConfig, seed: int) -> dict[str, np.ndarray]:
    """Random tensors under the reference's own names and shapes; norm weights random around 1."""
    rng = np.random.default_rng(seed)
    shapes = {name: tuple(t.shape) for name, t in ReferenceDrafter(zlab_config(config)).state_dict().items()}
    return {name: (1.0 + 0.2 * rng.standard_normal(shape) if name.endswith("norm.weight")
                   else 0.15 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def packed_rows(seed: int, num_features: int):
    """Two rows, each two documents plus 4 padding tokens; positions restart in each document."""
    rng = np.random.default_rng(seed)
    segments, positions = [], []
    for lengths in ((9, 11), (14, 6)):
        segments.append(np.concatenate([np.full(n, d) for d, n in enumerate(lengths)] + [np.full(4, PAD)]))
        positions.append(np.concatenate([np.arange(n) for n in lengths] + [np.zeros(4, int)]))
    input_ids = rng.integers(0, MASK_ID, (2, SEQ_LEN))
    features = rng.standard_normal((2, SEQ_LEN, num_features * HIDDEN)).astype(np.float32)
    return features, input_ids, np.stack(positions), np.stack(segments).astype(np.int32)


def _forward(drafter, features, embeds, positions, segments, grid):
    return drafter(features, embeds, DrafterInputs.from_rows(grid, positions, segments))[0]


forward = nnx.jit(_forward, static_argnames="grid")


def relative_error(actual, expected) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float64) - expected)) / np.max(np.abs(expected)))
