"""qwen3_5_moe target against transformers' Qwen3_5MoeForCausalLM / Qwen3_5MoeForConditionalGeneration (CPU,
fp32, random weights including norms): every layer (Gated DeltaNet and gated attention, each with routed experts
and the sigmoid-gated shared expert) and the logits in both saved layouts, the fused expert layout of the
published files and tied embeddings; packed documents against each document run alone by transformers; the
FLOP count, a checkpoint missing one expert's tensor, and config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from dflash_jax.models.qwen3_5_config import Qwen3_5Config
from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.sharding import make_mesh
from dflash_jax.weights.targets import load_target
from tests.hf_fixtures import QWEN3_5_MOE_TEXT_CONFIG, fuse_experts, hf_forward, relative_error, save_qwen3_5_moe

TOLERANCE = 1e-4  # as the dense hybrid's parity (tests/models/test_qwen3_5.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(directory, transformers model) per layout: text-only per expert, multimodal per expert, and the
    text-only one rewritten with fused experts, read back by transformers itself as its reference."""
    root = tmp_path_factory.mktemp("qwen3_5_moe")
    causal_lm = save_qwen3_5_moe(root / "causal_lm", seed=0)
    multimodal = save_qwen3_5_moe(root / "conditional_generation", multimodal=True, seed=1)
    tied = save_qwen3_5_moe(root / "tied", seed=2, tie_word_embeddings=True)
    fused = fuse_experts(root / "causal_lm", root / "fused")
    fused_model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(fused, dtype=torch.float32).eval()
    return {"causal_lm": (root / "causal_lm", causal_lm),
            "conditional_generation": (root / "conditional_generation", multimodal),
            "tied": (root / "tied", tied), "fused": (fused, fused_model)}


@nnx.jit(static_argnums=(2,))
def forward(model, ids, feature_ids, positions=None, segments=None):
    """Features and logits; one document per row unless positions and segment ids are given."""
    if positions is None:
        positions, segments = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape), jnp.zeros_like(ids)
    out = model(ids, positions, segments, feature_ids)
    return out.features, model.logits(out.hidden)


# Tied embeddings in make test-slow (make test ties them for the Qwen3-MoE family: test_moe_targets.py).
@pytest.mark.parametrize("layout", ["causal_lm", "conditional_generation", pytest.param("tied", marks=pytest.mark.slow),
                                    "fused"])
def test_parity_with_transformers(checkpoints, layout):
    directory, hf_model = checkpoints[layout]
    model, config = load_target(directory, param_dtype=jnp.float32)
    assert config.moe.num_experts == 6 and config.moe.has_shared_expert and config.intermediate_size == 0
    assert config.tie_word_embeddings == (layout == "tied")
    ids = np.random.default_rng(2).integers(0, config.vocab_size, (2, 37))
    hf_logits, _, hf_layers = hf_forward(hf_model, ids)
    layers = tuple(range(config.num_hidden_layers))
    features, logits = forward(model, jnp.asarray(ids), layers)
    assert relative_error(logits, hf_logits) < TOLERANCE
    for layer in layers:  # each decoder layer's own output (HF's last hidden_states entry is final-normed)
        assert relative_error(features[:, :, layer], hf_layers[layer]) < TOLERANCE, layer


def test_packed_documents_equal_each_document_alone_in_transformers(checkpoints):
    """Two documents and padding in one row: each document's logits and every layer's output equal what
    transformers computes for that document alone (the second starts mid-chunk of the delta rule, and the conv
    window straddles the boundary)."""
    directory, hf_model = checkpoints["causal_lm"]
    model, config = load_target(directory, param_dtype=jnp.float32)
    rng = np.random.default_rng(3)
    lengths, padding = (45, 30), 5
    documents = [rng.integers(0, config.vocab_size, length) for length in lengths]
    ids = np.concatenate([*documents, np.zeros(padding, int)])[None]
    positions = np.concatenate([np.arange(n) for n in (*lengths, padding)])[None]
    segments = np.repeat([1, 2, 0], (*lengths, padding))[None]
    layers = tuple(range(config.num_hidden_layers))
    features, logits = forward(model, jnp.asarray(ids), layers, jnp.asarray(positions), jnp.asarray(segments))
    start = 0
    for document in documents:
        hf_logits, _, hf_layers = hf_forward(hf_model, document[None])
        span = slice(start, start + len(document))
        assert relative_error(logits[:, span], hf_logits) < TOLERANCE
        for layer in layers:
            assert relative_error(features[:, span, layer], hf_layers[layer]) < TOLERANCE, layer
        start += len(document)


@pytest.mark.slow  # about 6 s: the sharded compile
def test_sharded_forward_under_the_train_steps_mesh_keeps_outputs(checkpoints):
    """Weights placed on an (fsdp=4, tensor=2) mesh and the activation constraints active (the mesh entered as
    the train step enters it): the same features and logits, experts stacked on their `expert` axis."""
    directory = checkpoints["causal_lm"][0]
    mesh = make_mesh(1, 4, 2)
    plain, _ = load_target(directory, param_dtype=jnp.float32)
    sharded, _ = load_target(directory, param_dtype=jnp.float32, mesh=mesh)
    assert sharded.periods.layers[0].mlp.experts.gate_proj[...].shape == (1, 6, 32, 16)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 96, (4, 16)))
    expected = forward(plain, ids, (0, 3))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        got = forward(sharded, ids, (0, 3))
    for got_array, expected_array in zip(got, expected):  # features, logits
        assert relative_error(got_array, expected_array) < 1e-5  # sharded sums round differently


def test_fused_layout_loads_the_same_weights(checkpoints):
    per_expert, _ = load_target(checkpoints["causal_lm"][0], param_dtype=jnp.float32)
    fused, _ = load_target(checkpoints["fused"][0], param_dtype=jnp.float32)
    fused_vars = dict(nnx.to_flat_state(nnx.state(fused)))
    for path, variable in nnx.to_flat_state(nnx.state(per_expert)):
        np.testing.assert_array_equal(fused_vars[path].get_value(), variable.get_value(), err_msg=str(path))


def test_flop_count_takes_the_k_experts_and_the_shared_expert(checkpoints):
    """layer_matmul_params against the transformers model's own weights: every projection of the token mixers
    (the depthwise conv included; not norms, A_log or dt_bias), the router, the shared expert and its gate, and
    num_experts_per_tok of the routed experts (not all of them)."""
    directory, hf_model = checkpoints["causal_lm"]
    _, config = load_target(directory, param_dtype=jnp.float32)
    expected = 0
    for name, parameter in hf_model.model.layers.named_parameters():
        if "norm" in name or name.endswith(("A_log", "dt_bias")):
            continue
        share = config.moe.top_k / config.moe.num_experts if ".mlp.experts." in name else 1
        expected += parameter.numel() * share
    assert config.layer_matmul_params == expected


@pytest.mark.parametrize("layout, missing", [
    ("causal_lm", "model.layers.2.mlp.experts.4.up_proj.weight"),
    ("fused", "model.layers.1.mlp.experts.down_proj"),
])
def test_a_missing_expert_tensor_is_named(checkpoints, tmp_path, layout, missing):
    source = checkpoints[layout][0]
    tensors = load_file(source / "model.safetensors")
    del tensors[missing]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((source / "config.json").read_text())
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_target(tmp_path / "bad", param_dtype=jnp.float32)
    assert str(error.value) == f"{tmp_path / 'bad'}: missing tensors (1): {missing}"


@pytest.mark.parametrize("layout, name, shape, message", [
    ("causal_lm", "model.layers.2.mlp.experts.4.up_proj.weight", (17, 32), "has shape (17, 32), expected (16, 32)"),
    ("fused", "model.layers.1.mlp.experts.gate_up_proj", (6, 30, 32),
     "has shape (6, 30, 32), expected (6, 32, 32) for this config (fused experts)"),
])
def test_a_mis_shaped_expert_tensor_is_named(checkpoints, tmp_path, layout, name, shape, message):
    source = checkpoints[layout][0]
    tensors = load_file(source / "model.safetensors")
    tensors[name] = np.zeros(shape, np.float32)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((source / "config.json").read_text())
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        load_target(tmp_path / "bad", param_dtype=jnp.float32)
    assert str(error.value).startswith(f"{tmp_path / 'bad'}: tensor {name} {message}")


def test_each_tensor_is_read_once_and_a_layer_at_a_time_goes_to_its_shards(tmp_path, monkeypatch):
    """Fused experts of 8 layers (two repetitions of the period) loaded onto an (fsdp=4, tensor=2) mesh: every
    tensor read once (gate and up come from one read of gate_up_proj), no host array larger than one layer's
    experts handed to the devices, and each device holding its tensor half of the experts (design §8.4)."""
    from dflash_jax.weights import mapping
    from dflash_jax.weights.safetensors_dir import CheckpointReader
    from tests.train_fixtures import make_qwen3_5_moe_target

    directory = fuse_experts(make_qwen3_5_moe_target(tmp_path / "hf"), tmp_path / "fused")
    reads, placed = [], []
    read, device_put = CheckpointReader.read, jax.device_put
    monkeypatch.setattr(CheckpointReader, "read", lambda self, name, index=None: reads.append(name) or
                        read(self, name, index))
    monkeypatch.setattr(mapping.jax, "device_put", lambda value, *args, **kwargs: (
        placed.append(value.shape) if isinstance(value, np.ndarray) else None) or device_put(value, *args, **kwargs))
    model, config = load_target(directory, param_dtype=jnp.float32, mesh=make_mesh(1, 4, 2))
    assert sorted(reads) == sorted(CheckpointReader(directory).names())  # each once
    one_layer = config.moe.num_experts * config.hidden_size * config.moe.expert_intermediate_size
    assert max(np.prod(shape) for shape in placed) <= max(one_layer, config.vocab_size * config.hidden_size)
    assert placed.count((8, 64, 32)) == 2 * 8 and placed.count((8, 32, 64)) == 8  # per layer: gate, up; down
    gate = model.periods.layers[0].mlp.experts.gate_proj[...]  # [repetitions, E, H, I]
    assert gate.shape == (2, 8, 64, 32) and {shard.data.shape for shard in gate.addressable_shards} == {(2, 4, 16, 32)}


@pytest.mark.parametrize("change, field", [
    ({"num_experts": None}, "num_experts"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
])
def test_config_errors_name_the_field(change, field):
    config = {"model_type": "qwen3_5_moe", "text_config": {**QWEN3_5_MOE_TEXT_CONFIG, **change}}
    with pytest.raises(ValueError, match=field):
        Qwen3_5Config.from_hf(config)


def test_nested_and_flat_configs_agree():
    nested = Qwen3_5Config.from_hf({"model_type": "qwen3_5_moe", "text_config": QWEN3_5_MOE_TEXT_CONFIG})
    flat = Qwen3_5Config.from_hf({"model_type": "qwen3_5_moe_text", **QWEN3_5_MOE_TEXT_CONFIG})
    assert nested == flat and flat.moe.top_k == 2 and flat.moe.normalize_top_k
    with pytest.raises(ValueError, match="intermediate_size"):  # a dense Qwen3.5 config must have its MLP width
        Qwen3_5Config.from_hf({"model_type": "qwen3_5_text", **QWEN3_5_MOE_TEXT_CONFIG})
