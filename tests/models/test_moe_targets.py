"""qwen3_moe target against transformers.Qwen3MoeForCausalLM (CPU, fp32, random weights including norms)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dflash_jax.weights.targets import load_target
from tests.hf_fixtures import randomize_parameters

TOLERANCE = 1e-4


@pytest.mark.parametrize("normalize,tied", [(True, False), (False, True)])
def test_qwen3_moe_logits_and_features_match_transformers(tmp_path, normalize, tied):
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=normalize, tie_word_embeddings=tied, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = randomize_parameters(transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval(), seed=0)
    hf.save_pretrained(tmp_path)
    model, _ = load_target(tmp_path, param_dtype=jnp.float32)
    ids = np.random.default_rng(0).integers(0, 96, (2, 21))
    with torch.no_grad():
        out = hf(torch.as_tensor(ids), output_hidden_states=True)
    positions = jnp.broadcast_to(jnp.arange(21), ids.shape)
    ours = model(jnp.asarray(ids), positions, jnp.ones(ids.shape, jnp.int32), (0,))
    logits = np.asarray(model.logits(ours.hidden))
    expected = out.logits.numpy()
    assert np.max(np.abs(logits - expected)) / np.max(np.abs(expected)) < TOLERANCE
    feature, expected = np.asarray(ours.features[:, :, 0]), out.hidden_states[1].numpy()
    assert np.max(np.abs(feature - expected)) / np.max(np.abs(expected)) < TOLERANCE


def test_flop_count_takes_the_k_experts_a_token_reaches(tmp_path):
    """layer_matmul_params against the transformers model's own weights: per layer q/k/v/o, the router and
    num_experts_per_tok of the experts (not all of them)."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    _, ours = load_target(tmp_path, param_dtype=jnp.float32)
    hf = transformers.Qwen3MoeForCausalLM(config)
    expected = 0
    for layer in hf.model.layers:
        attention = layer.self_attn
        expected += sum(p.numel() for m in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
                        for p in m.parameters())
        experts = layer.mlp.experts
        one_expert = sum(p.numel() for p in experts.parameters()) // config.num_experts
        expected += layer.mlp.gate.weight.numel() + config.num_experts_per_tok * one_expert
    assert ours.layer_matmul_params == expected
