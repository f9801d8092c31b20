"""Decoding against the mixture-of-experts targets (design §8.5, §9.3, §9.4): plain greedy decoding with the
decode caches equals transformers' own greedy generation, and the speculative and DDTree decoders commit exactly
those tokens.

CPU, fp32, tiny random checkpoints written by transformers' save_pretrained: a Qwen3-MoE with a dense layer among
its sparse ones and a Qwen3.5-MoE (Gated DeltaNet and gated attention, shared expert), and a random drafter.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dflash_jax.eval.ddtree_decode import DDTreeGenerator
from dflash_jax.eval.generate import SpeculativeGenerator
from dflash_jax.weights.targets import load_target
from tests.decode_check import tiny_drafter
from tests.hf_fixtures import QWEN3_5_MOE_TEXT_CONFIG, randomize_parameters, randomize_qwen3_5

VOCAB, BLOCK, BUDGET, NEW_TOKENS = 96, 4, 6, 23
PROMPT_LENGTHS = (3, 7, 12)


def _qwen3_moe() -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256)
    return randomize_parameters(transformers.Qwen3MoeForCausalLM(config), seed=0)


def _qwen3_5_moe() -> torch.nn.Module:
    config = transformers.Qwen3_5MoeTextConfig(**{**QWEN3_5_MOE_TEXT_CONFIG, "hidden_size": 64, "num_experts": 8})
    model = transformers.Qwen3_5MoeForCausalLM(config)
    randomize_qwen3_5(model, seed=0)
    return model


# The hybrid family's three decoders add their compiles: in make test-slow.
@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def family(request, tmp_path_factory):
    """(transformers model, our target loaded from its save_pretrained directory)."""
    torch.manual_seed(0)
    hf = {"qwen3_moe": _qwen3_moe, "qwen3_5_moe": _qwen3_5_moe}[request.param]().to(torch.float32).eval()
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf, load_target(directory, param_dtype=jnp.float32)[0]


def test_every_decoder_commits_transformers_greedy_tokens(family):
    hf, target = family
    drafter = tiny_drafter(VOCAB, BLOCK)
    decoders = {"plain": SpeculativeGenerator(target, None, prefill_len=16, capacity=48),
                "speculative": SpeculativeGenerator(target, drafter, prefill_len=16, capacity=48),
                "ddtree": DDTreeGenerator(target, drafter, budget=BUDGET, prefill_len=16, capacity=48)}
    rng = np.random.default_rng(0)
    for length in PROMPT_LENGTHS:
        prompt = rng.integers(0, VOCAB - 1, length).astype(np.int32)
        with torch.no_grad():
            expected = hf.generate(torch.as_tensor(prompt[None], dtype=torch.long), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, length:].numpy()
        assert len(expected) == NEW_TOKENS
        for name, decoder in decoders.items():
            np.testing.assert_array_equal(decoder.generate(prompt, NEW_TOKENS).tokens, expected,
                                          err_msg=f"{name}, prompt of {length}")
