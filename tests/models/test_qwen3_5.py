"""Qwen3.5/3.6 hybrid target: config parsing, parity with transformers (both checkpoint layouts, loaded from
real files), packed documents, the 27B abstract parameter count, and loader errors."""

from __future__ import annotations

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file

from configs.qwen27b import target_config
from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3_5, Qwen3_5Config
from dflash_jax.sharding import make_mesh, state_shardings
from dflash_jax.weights.targets import load_target
from tests.decode_check import max_relative_error_of_cached_logits
from tests.hf_fixtures import QWEN3_5_TEXT_CONFIG, QWEN3_5_VISION_CONFIG, randomize_qwen3_5

LIN, FULL = LINEAR_ATTENTION, FULL_ATTENTION

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two random tiny checkpoints saved by transformers: text-only Qwen3_5ForCausalLM (`model.*`) and
    Qwen3_5ForConditionalGeneration (`model.language_model.*` + `model.visual.*`, sharded with an index)."""
    from transformers import (Qwen3_5Config as HFConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5TextConfig)

    root = tmp_path_factory.mktemp("qwen3_5")
    text_only = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5_TEXT_CONFIG)).eval()
    randomize_qwen3_5(text_only, seed=0)
    text_only.save_pretrained(root / "causal_lm")
    multimodal = Qwen3_5ForConditionalGeneration(
        HFConfig(text_config=QWEN3_5_TEXT_CONFIG, vision_config=QWEN3_5_VISION_CONFIG,
                 tie_word_embeddings=False)).eval()
    randomize_qwen3_5(multimodal, seed=1)
    multimodal.save_pretrained(root / "conditional_generation", max_shard_size="200KB")
    assert (root / "conditional_generation" / "model.safetensors.index.json").is_file()
    return {"causal_lm": (root / "causal_lm", text_only),
            "conditional_generation": (root / "conditional_generation", multimodal)}


@nnx.jit(static_argnums=(4,))
def forward(model, ids, positions, segments, feature_ids):
    out = model(ids, positions, segments, feature_ids)
    return out.hidden, out.features, model.logits(out.hidden)


def relative_error(actual, expected) -> float:
    """max |actual − expected| / max |expected|."""
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(np.asarray(actual, np.float64) - expected)) / np.max(np.abs(expected)))


@pytest.mark.parametrize("layout", ["causal_lm", "conditional_generation"])
def test_parity_with_transformers(checkpoints, layout):
    directory, hf_model = checkpoints[layout]
    model, config = load_target(directory, param_dtype=jnp.float32)
    layers = config.num_hidden_layers
    assert config.layer_types == (LIN, LIN, LIN, FULL) * 2 and len(config.layer_period()) == 4
    rng = np.random.default_rng(2)
    for length in (150, 64):  # 150: three chunks with padding; 64: exactly one
        ids = rng.integers(0, config.vocab_size, (2, length))
        with torch.no_grad():
            hf_out = hf_model(input_ids=torch.as_tensor(ids), output_hidden_states=True)
        positions = np.broadcast_to(np.arange(length), ids.shape)
        hidden, features, logits = forward(model, ids, positions, np.zeros_like(ids), tuple(range(layers)))
        assert relative_error(logits, hf_out.logits) < 1e-4
        for layer in range(layers - 1):  # HF hidden_states[i + 1] is the output of layer i ...
            assert relative_error(features[:, :, layer], hf_out.hidden_states[layer + 1]) < 1e-4, (length, layer)
        assert relative_error(hidden, hf_out.hidden_states[layers]) < 1e-4  # ... but its last is final-normed


def test_decode_cache_logits_equal_the_full_forward(checkpoints):
    """Batched prompts of 5, 11 and 70 tokens (70: two gated-delta chunks in the prefill), left-padded, then
    single tokens and short blocks: attention K/V, conv inputs and recurrent state carried (fp32, 1e-4)."""
    model, config = load_target(checkpoints["causal_lm"][0], param_dtype=jnp.float32)
    assert max_relative_error_of_cached_logits(model, config.vocab_size, (5, 11, 70)) < 1e-4


def test_load_target_in_bfloat16_drifts_no_more_than_transformers(checkpoints):
    directory, hf_model = checkpoints["causal_lm"]
    model, config = load_target(directory, param_dtype=jnp.bfloat16)
    assert isinstance(model, Qwen3_5) and config.num_hidden_layers == 8
    assert model.embed_tokens.embedding.dtype == jnp.bfloat16
    layer = model.periods.layers[0].linear_attn
    assert layer.A_log.dtype == jnp.float32 and layer.dt_bias.dtype == jnp.float32
    ids = np.random.default_rng(5).integers(0, config.vocab_size, (1, 100))
    hidden, features, logits = forward(model, ids, np.arange(100)[None], np.zeros_like(ids), (1,))
    assert hidden.dtype == features.dtype == jnp.bfloat16
    # This random net amplifies rounding strongly (transformers' own bf16 logits are ~10% off its fp32 ones),
    # so bf16 is judged against transformers' bf16 drift rather than a fixed tolerance.
    with torch.no_grad():
        fp32_logits = hf_model(input_ids=torch.as_tensor(ids)).logits
        hf_bf16_logits = copy.deepcopy(hf_model).to(torch.bfloat16)(input_ids=torch.as_tensor(ids)).logits
    hf_drift = relative_error(hf_bf16_logits.float(), fp32_logits)
    assert relative_error(np.asarray(logits, np.float32), fp32_logits) < 1.5 * hf_drift


def test_load_onto_mesh_shards_weights_and_keeps_outputs(checkpoints):
    assert jax.device_count() == 8, "tests/conftest.py sets 8 host devices"
    directory = checkpoints["conditional_generation"][0]
    ids = np.random.default_rng(4).integers(0, 96, (2, 64))  # the parity test's shapes: its compile is reused
    inputs = (ids, np.broadcast_to(np.arange(64), ids.shape), np.zeros_like(ids), tuple(range(8)))
    plain, _ = load_target(directory, param_dtype=jnp.float32)
    sharded, _ = load_target(directory, param_dtype=jnp.float32, mesh=make_mesh(1, 4, 2))
    gdn = sharded.periods.layers[0].linear_attn
    assert gdn.in_proj_q.kernel[...].sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    assert gdn.in_proj_q.kernel[...].addressable_shards[0].data.shape == (2, 64 // 4, 32 // 2)
    assert gdn.in_proj_v.kernel[...].addressable_shards[0].data.shape == (2, 64 // 4, 144 // 2)
    assert gdn.conv1d_k.weight[...].sharding.spec == PartitionSpec(None, "tensor", None)
    assert gdn.A_log[...].sharding.spec == PartitionSpec(None, "tensor")
    for got, expected in zip(forward(sharded, *inputs), forward(plain, *inputs)):  # hidden, features, logits
        assert relative_error(got, expected) < 1e-5  # sharded sums round differently


def test_packed_documents_equal_documents_alone(checkpoints):
    model, config = load_target(checkpoints["causal_lm"][0], param_dtype=jnp.float32)
    feature_ids = (0, 3, 6)
    rng = np.random.default_rng(3)
    lengths = (90, 70)  # the second document starts mid-chunk; the conv window (K=4) straddles the boundary
    documents = [rng.integers(0, config.vocab_size, length) for length in lengths]
    packed = (np.concatenate(documents)[None], np.concatenate([np.arange(n) for n in lengths])[None],
              np.repeat(np.arange(len(lengths)), lengths)[None])
    # Each document alone in its own row, right-padded (padding is a later segment, so it cannot leak back).
    width = max(lengths)
    alone = (np.stack([np.pad(doc, (0, width - len(doc))) for doc in documents]),
             np.broadcast_to(np.arange(width), (len(lengths), width)),
             np.stack([np.arange(width) >= n for n in lengths]).astype(int))
    packed_hidden, packed_features, _ = forward(model, *packed, feature_ids)
    alone_hidden, alone_features, _ = forward(model, *alone, feature_ids)
    for row, (start, length) in enumerate(zip(np.cumsum((0,) + lengths[:-1]), lengths)):
        window = slice(start, start + length)
        assert relative_error(packed_hidden[0, window], alone_hidden[row, :length]) < 1e-5
        assert relative_error(packed_features[0, window], alone_features[row, :length]) < 1e-5


def test_27b_abstract_parameter_count():
    config = target_config()
    assert config.layer_period() == (LIN, LIN, LIN, FULL) and config.rotary_dim == 64
    abstract = nnx.eval_shape(lambda: Qwen3_5(config, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)  # nothing allocated
    count = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    assert count == 26_895_998_464  # design §11, from a meta-device HF instantiation
    for path, sharding in nnx.to_flat_state(state_shardings(nnx.state(abstract), make_mesh(1, 4, 2))):
        axes = [axis for axis in sharding.get_value().spec if axis is not None]
        assert len(axes) == len(set(axes)), (path, sharding.get_value().spec)  # no mesh axis used twice
    attention = abstract.periods.layers[3].self_attn
    assert attention.q_proj.kernel.shape == (16, 5120, 12288)
    delta_net = abstract.periods.layers[0].linear_attn
    assert delta_net.conv1d_q.weight.shape == delta_net.conv1d_k.weight.shape == (16, 2048, 4)
    assert delta_net.conv1d_v.weight.shape == (16, 6144, 4)


# --- config parsing ---------------------------------------------------------------------------------------

def test_config_from_wrapped_and_flat_forms():
    wrapped = Qwen3_5Config.from_hf({"model_type": "qwen3_5", "tie_word_embeddings": False,
                                     "text_config": {**QWEN3_5_TEXT_CONFIG, "layer_types": None}})
    legacy = {key: value for key, value in QWEN3_5_TEXT_CONFIG.items() if key != "rope_parameters"}
    flat = Qwen3_5Config.from_hf({**legacy, "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                  "full_attention_interval": 4})
    assert wrapped == flat
    assert flat.layer_types == (LIN, LIN, LIN, FULL) * 2 and flat.rope_theta == 1e7 and flat.rotary_dim == 8


def test_layer_period_falls_back_to_whole_stack():
    config = Qwen3_5Config.from_hf({**QWEN3_5_TEXT_CONFIG, "num_hidden_layers": 3, "layer_types": [LIN, FULL, FULL]})
    assert config.layer_period() == (LIN, FULL, FULL)
    abstract = nnx.eval_shape(lambda: Qwen3_5(config, rngs=nnx.Rngs(0)))
    assert abstract.periods.layers[2].self_attn.q_proj.kernel.shape == (1, 64, 256)  # one "repetition"
    assert Qwen3_5Config.from_hf({**QWEN3_5_TEXT_CONFIG, "full_attention_interval": 2}).layer_period() == (LIN, FULL)


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": None}, "hidden_size"),
    ({"layer_types": [LIN] * 7}, "layer_types"),
    ({"layer_types": [LIN] * 7 + ["sliding_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 5}, "linear_num_value_heads"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
    ({"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.1}}, "partial_rotary_factor"),
    ({"full_attention_interval": 0, "layer_types": None}, "full_attention_interval"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        Qwen3_5Config.from_hf({**QWEN3_5_TEXT_CONFIG, **change})


# --- loader errors ----------------------------------------------------------------------------------------

def rewrite_checkpoint(source, destination, edit):
    """Copy a single-file checkpoint, passing its tensors through `edit(dict) -> dict`."""
    destination.mkdir()
    shutil.copy(source / "config.json", destination / "config.json")
    save_file(edit(load_file(source / "model.safetensors")), destination / "model.safetensors")
    return destination


LAYER0 = "model.layers.0.linear_attn."


def test_visual_and_mtp_tensors_are_skipped(checkpoints, tmp_path):
    source = checkpoints["causal_lm"][0]
    extra = {"mtp.fc.weight": np.zeros((64, 128), np.float32),
             "mtp.layers.0.self_attn.q_proj.weight": np.zeros((256, 64), np.float32),
             "model.visual.blocks.0.attn.qkv.weight": np.zeros((96, 32), np.float32)}
    directory = rewrite_checkpoint(source, tmp_path / "extra", lambda tensors: {**tensors, **extra})
    model, _ = load_target(directory, param_dtype=jnp.float32)
    expected = load_file(source / "model.safetensors")[LAYER0 + "conv1d.weight"][:, 0]
    delta_net = model.periods.layers[0].linear_attn  # HF's fused q|k|v rows, split in order
    loaded = np.concatenate([conv.weight[...][0] for conv in (delta_net.conv1d_q, delta_net.conv1d_k,
                                                                delta_net.conv1d_v)])
    np.testing.assert_array_equal(loaded, expected)


@pytest.mark.parametrize("edit, message", [
    (lambda t: {k: v for k, v in t.items() if k != LAYER0 + "A_log"},
     r"missing tensors \(1\): model\.layers\.0\.linear_attn\.A_log"),
    (lambda t: {**t, "model.layers.0.linear_attn.extra.weight": np.zeros(3, np.float32)},
     r"unexpected tensors \(1\): model\.layers\.0\.linear_attn\.extra\.weight"),
    (lambda t: {**t, LAYER0 + "in_proj_z.weight": np.zeros((144, 65), np.float32)},
     r"in_proj_z\.weight has shape \(144, 65\), expected \(144, 64\)"),
    (lambda t: {**t, LAYER0 + "conv1d.weight": np.zeros((208, 1, 5), np.float32)},
     r"conv1d\.weight has shape \(208, 1, 5\), expected \(208, 1, 4\)"),
    (lambda t: {**t, LAYER0 + "in_proj_qkv.weight": np.zeros((200, 64), np.float32)},
     r"in_proj_qkv\.weight has shape \(200, 64\), expected \(208, 64\)"),
])
def test_loader_reports_bad_checkpoints(checkpoints, tmp_path, edit, message):
    directory = rewrite_checkpoint(checkpoints["causal_lm"][0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_target(directory, param_dtype=jnp.float32)


def test_loader_reports_bad_config(checkpoints, tmp_path):
    directory = rewrite_checkpoint(checkpoints["causal_lm"][0], tmp_path / "bad_config", lambda t: t)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "linear_num_key_heads": 4}))
    with pytest.raises(CheckpointError, match="config.json.*linear_num_value_heads"):
        load_target(directory, param_dtype=jnp.float32)
