"""DSpark export (design §18.1): the speculators layout on disk, tensor by tensor and key by key, read back into
NNX, and the vLLM serve line; vLLM's own parsing and loading of it is tests/serving/check_vllm_dspark.py."""

from __future__ import annotations

import json
import shlex

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from dflash_jax.models.drafter import Drafter
from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.weights.drafter_files import drafter_to_torch_layout, export_drafter, load_drafter_dir, serve_command
from tests.drafter_fixtures import HIDDEN, MASK_ID, SLIDING, VOCAB, make_config

RANK = 6


def dspark_config():
    return make_config((SLIDING, SLIDING), 5, method="dspark", markov_rank=RANK)


def bf16(value) -> np.ndarray:
    return np.asarray(value).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_dspark_export_has_vllms_names_and_config_and_reads_back(tmp_path):
    config = dspark_config()
    drafter = Drafter(config, rngs=nnx.Rngs(3))
    out = export_drafter(drafter, config, tmp_path / "dspark", target="Qwen/Qwen3-8B")
    tensors = load_file(out / "model.safetensors")

    # The heads under vLLM's Qwen3DSparkForCausalLM names, in PyTorch layout: an embedding [V, r], a Linear
    # r -> V ([V, r]) and the confidence Linear [H + r] -> 1; the backbone names are the DFlash ones.
    w1, w2 = drafter.markov_head.w1[...], drafter.markov_head.w2[...]
    np.testing.assert_array_equal(tensors["markov_head.markov_w1.weight"].astype(np.float32), bf16(w1))
    np.testing.assert_array_equal(tensors["markov_head.markov_w2.weight"].astype(np.float32), bf16(w2).T)
    assert tensors["confidence_head.proj.weight"].shape == (1, HIDDEN + RANK)
    np.testing.assert_array_equal(tensors["confidence_head.proj.bias"].astype(np.float32),
                                  bf16(drafter.confidence_head.bias[...]))
    heads = {name for name in tensors if name.startswith(("markov_head.", "confidence_head."))}
    assert heads == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                     "confidence_head.proj.bias"}
    assert not [name for name in tensors if "embed_tokens" in name or "lm_head" in name]
    assert "fc.weight" in tensors and "layers.1.self_attn.q_proj.weight" in tensors

    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["architectures"] == ["DSparkDraftModel"]
    assert raw["aux_hidden_state_layer_ids"] == [i + 1 for i in config.target_layer_ids]
    assert (raw["markov_rank"], raw["mask_token_id"], raw["block_size"]) == (RANK, MASK_ID, config.block_size)
    assert raw["sample_from_anchor"] is True and raw["enable_confidence_head"] is True
    assert raw["confidence_head_with_markov"] is True and raw["draft_vocab_size"] == VOCAB
    spec = raw["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == config.block_size
    assert spec["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"
    layer = raw["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["layer_types"] == list(config.layer_types)
    assert layer["sliding_window"] == 5 and "dflash_config" not in layer

    loaded, loaded_config = load_drafter_dir(out)
    assert loaded_config == config
    expected = drafter_to_torch_layout(drafter)
    for name, value in drafter_to_torch_layout(loaded).items():
        np.testing.assert_array_equal(value, bf16(expected[name]), err_msg=name)


@pytest.mark.parametrize("key, value", [("markov_head_type", "gated"), ("sample_from_anchor", False),
                                        ("enable_confidence_head", False), ("draft_vocab_size", 32)])
def test_dspark_settings_the_drafter_cannot_reproduce_are_refused_in_one_line(tmp_path, key, value):
    config = dspark_config()
    out = export_drafter(Drafter(config, rngs=nnx.Rngs(0)), config, tmp_path / "dspark")
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(raw | {key: value}))
    with pytest.raises(CheckpointError, match=f"unsupported DSpark settings: {key}=") as error:
        load_drafter_dir(out)
    assert "\n" not in str(error.value)


def test_dspark_serve_line_names_method_dspark_on_the_v2_runner():
    config = dspark_config()
    words = shlex.split(serve_command("Qwen/Qwen3-8B", "/ckpt/drafter", config))
    assert words[0] == "VLLM_USE_V2_MODEL_RUNNER=1"
    assert json.loads(words[-1]) == {"method": "dspark", "model": "/ckpt/drafter",
                                     "num_speculative_tokens": config.block_size}
