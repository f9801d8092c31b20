"""The small drafter the generation and exact-τ tests share."""

from __future__ import annotations

from dflash_jax.models.drafter import DrafterConfig


VOCAB, BLOCK = 96, 4


def drafter_config() -> DrafterConfig:
    return DrafterConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=5, block_size=BLOCK,
                         target_layer_ids=(0, 2), num_target_layers=3, mask_token_id=VOCAB - 1, vocab_size=VOCAB,
                         max_position_embeddings=256)
