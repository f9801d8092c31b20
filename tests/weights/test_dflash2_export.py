"""DFlash2 export (design §18.5): the z-lab layout with the DFlash2 architecture and keys, tensor by tensor under
vLLM's names, read back into NNX, the model card and the vLLM serve line; vLLM's own parsing and loading of it is
tests/serving/check_vllm_dflash2.py."""

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
from dflash_jax.weights.model_card import TrainingFacts, model_card
from tests.drafter_fixtures import FULL, HIDDEN, MASK_ID, VOCAB, make_config

TAPS, GROUP, RANK, TOP_K = 2, 8, 6, 5


def dflash2_config():
    return make_config((FULL, FULL), method="dflash2", conv_kernel_size=TAPS, conv_group_size=GROUP,
                       selector_rank=RANK, selector_top_k=TOP_K)


def bf16(value) -> np.ndarray:
    return np.asarray(value).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_dflash2_export_has_vllms_names_and_config_and_reads_back(tmp_path):
    config = dflash2_config()
    drafter = Drafter(config, rngs=nnx.Rngs(3))
    out = export_drafter(drafter, config, tmp_path / "dflash2")
    tensors = load_file(out / "model.safetensors")

    # vLLM's DFlash2Qwen3ForCausalLM names and PyTorch shapes: base kernels [2, K, H], kernel projections
    # [2·K·G, H] (a Linear H -> 2·K·G), codebooks [V, r] and the hidden projection [r, H].
    groups = HIDDEN // GROUP
    for layer in range(config.num_hidden_layers):
        for sublayer in ("attention_conv", "mlp_conv"):
            conv = getattr(drafter.layers[layer], sublayer)
            prefix = f"layers.{layer}.{sublayer}"
            np.testing.assert_array_equal(tensors[f"{prefix}.base_kernel"].astype(np.float32),
                                          bf16(conv.base_kernel[...]))
            assert tensors[f"{prefix}.base_kernel"].shape == (2, TAPS, HIDDEN)
            assert tensors[f"{prefix}.kernel_projection.weight"].shape == (2 * TAPS * groups, HIDDEN)
    selector = drafter.candidate_selector
    np.testing.assert_array_equal(tensors["candidate_selector.predecessor_codebook"].astype(np.float32),
                                  bf16(selector.predecessor_codebook[...]))
    np.testing.assert_array_equal(tensors["candidate_selector.hidden_projection.weight"].astype(np.float32),
                                  bf16(selector.hidden_projection.kernel[...]).T)
    assert tensors["candidate_selector.successor_codebook"].shape == (VOCAB, RANK)
    new = {name for name in tensors if "_conv." in name or name.startswith("candidate_selector.")}
    assert len(new) == 4 * config.num_hidden_layers + 3
    assert not [name for name in tensors if "embed_tokens" in name or "lm_head" in name]

    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": list(config.target_layer_ids),
                                    "block_size": config.block_size, "conv_kernel_size": TAPS,
                                    "conv_group_size": GROUP, "selector_rank": RANK, "selector_top_k": TOP_K}

    loaded, loaded_config = load_drafter_dir(out)
    assert loaded_config == config
    expected = drafter_to_torch_layout(drafter)
    for name, value in drafter_to_torch_layout(loaded).items():
        np.testing.assert_array_equal(value, bf16(expected[name]), err_msg=name)


@pytest.mark.parametrize("value", [None, 0, "16"])
def test_a_dflash2_config_without_its_keys_is_refused_in_one_line(tmp_path, value):
    config = dflash2_config()
    out = export_drafter(Drafter(config, rngs=nnx.Rngs(0)), config, tmp_path / "dflash2")
    raw = json.loads((out / "config.json").read_text())
    raw["dflash_config"]["conv_group_size"] = value
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"needs positive ints dflash_config.*conv_group_size={value!r}") as error:
        load_drafter_dir(out)
    assert "\n" not in str(error.value)


def test_dflash2_serve_line_and_card_name_method_dflash_on_the_v2_runner():
    config = dflash2_config()
    line = serve_command("Qwen/Qwen3-8B", "/ckpt/drafter", config)
    words = shlex.split(line)
    assert words[0] == "VLLM_USE_V2_MODEL_RUNNER=1"
    assert json.loads(words[-1]) == {"method": "dflash", "model": "/ckpt/drafter",
                                     "num_speculative_tokens": config.block_size - 1}
    card = model_card(config, TrainingFacts(target="Qwen/Qwen3-8B", data_files=["a.jsonl"], steps=10),
                      "/ckpt/drafter")
    assert "# DFlash2 drafter for Qwen/Qwen3-8B" in card and line in card and "Serve with SGLang" not in card
    assert f"| selector rank / candidates | {RANK} / {TOP_K} |" in card
