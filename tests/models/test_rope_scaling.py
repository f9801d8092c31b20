"""RoPE scaling (YaRN, linear) in every target family against transformers (CPU, fp32, random weights), at
positions several times past YaRN's original window, and the one-line refusal of unsupported rope types."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from dflash_jax.models.layers import rope_frequencies
from tests.hf_fixtures import (QWEN3_5_MOE_TEXT_CONFIG, QWEN3_5_TEXT_CONFIG, qwen3_config, randomize_parameters,
                               randomize_qwen3_5, relative_error)
from dflash_jax.weights.targets import load_target

TOLERANCE = 1e-4
SEQ_LEN = 20
START = 300  # > 4x YaRN's original window of 64
ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    # original window from max_position_embeddings (as transformers), no truncation, DeepSeek-style mscale.
    "yarn-mscale-untruncated": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                                "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False},
    "linear": {"rope_type": "linear", "factor": 4.0},
}
MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)


def build(family: str, rope: dict, theta: float) -> torch.nn.Module:
    """A random fp32 transformers model of `family` with `rope` (+ theta) as its rope_parameters."""
    torch.manual_seed(0)
    if family == "qwen3":
        return randomize_parameters(transformers.Qwen3ForCausalLM(qwen3_config(
            num_hidden_layers=2, max_position_embeddings=512, rope_parameters={**rope, "rope_theta": theta})))
    if family == "qwen3_moe":
        return randomize_parameters(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **MOE, max_position_embeddings=512, rope_parameters={**rope, "rope_theta": theta})))
    base = QWEN3_5_TEXT_CONFIG if family == "qwen3_5" else QWEN3_5_MOE_TEXT_CONFIG
    text = {**base, "num_hidden_layers": 4, "max_position_embeddings": 512,
            "rope_parameters": {**base["rope_parameters"], **rope, "rope_theta": theta}}
    model = (transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text)) if family == "qwen3_5"
             else transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text)))
    randomize_qwen3_5(model, seed=0)
    return model


@functools.partial(nnx.jit, static_argnums=(4,))
def run(model, ids, positions, segments, feature_ids):
    out = model(ids, positions, segments, feature_ids)
    return out.features, model.logits(out.hidden)


# make test: each setting once, on a different family (every setting's tables are checked below); make test-slow:
# every family with every setting.
FAST = {("qwen3", "yarn"), ("qwen3_5", "yarn-mscale-untruncated"), ("qwen3_5_moe", "linear")}


@pytest.mark.parametrize("family, rope", [
    (family, rope) if (family, rope) in FAST else pytest.param(family, rope, marks=pytest.mark.slow)
    for family in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe") for rope in ROPES])
def test_scaled_rope_matches_transformers_past_the_original_window(tmp_path, family, rope):
    theta = 1e6 if family.startswith("qwen3_5") else 1e4
    hf = build(family, ROPES[rope], theta).to(torch.float32).eval()
    hf.save_pretrained(tmp_path)
    model, config = load_target(tmp_path, param_dtype=jnp.float32)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == ROPES[rope]["rope_type"]
    ids = np.random.default_rng(1).integers(0, 96, (2, SEQ_LEN))
    positions = np.broadcast_to(START + 7 * np.arange(SEQ_LEN), ids.shape)  # up to ~440
    with torch.no_grad():
        expected = hf(input_ids=torch.as_tensor(ids), position_ids=torch.as_tensor(positions),
                      output_hidden_states=True)
    features, logits = run(model, ids, positions, np.ones_like(ids), (0,))
    assert relative_error(features[:, :, 0], expected.hidden_states[1]) < TOLERANCE
    assert relative_error(logits, expected.logits) < TOLERANCE


@pytest.mark.parametrize("rope", list(ROPES))
def test_tables_match_transformers_rope_functions(rope):
    """inv_freq and the cos/sin attention scaling equal transformers' own (partial rotary dims included)."""
    config = transformers.Qwen3Config(head_dim=32, max_position_embeddings=512,
                                      rope_parameters={**ROPES[rope], "rope_theta": 1e6})
    inv_freq, scaling = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[ROPES[rope]["rope_type"]](config)
    ours = rope_frequencies(32, 1e6, ROPES[rope], 512)
    np.testing.assert_allclose(ours.inv_freq, inv_freq.numpy(), rtol=1e-6)
    assert ours.attention_scaling == pytest.approx(scaling, rel=1e-12)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling type 'dynamic' is not supported (supported: default, "
                                              "linear, yarn)"),
    ({"type": "longrope"}, "rope_scaling type 'longrope' is not supported"),
    ({"rope_type": "linear"}, "rope_scaling type 'linear' needs 'factor'"),
    ({"rope_type": "yarn", "factor": 4.0}, "needs 'original_max_position_embeddings'"),
])
def test_unsupported_or_incomplete_rope_is_one_clear_error(scaling, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        rope_frequencies(16, 1e4, scaling)
    assert "\n" not in str(error.value)
