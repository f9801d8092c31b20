"""load_target on real save_pretrained directories: sharding onto a mesh and every bad input."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec
from safetensors.torch import load_file, save_file

from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.sharding import make_mesh
from dflash_jax.weights.safetensors_dir import CheckpointReader
from dflash_jax.weights.targets import load_target
from tests.hf_fixtures import qwen3_config, save_qwen3

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An untied tiny checkpoint; tests copy it before damaging it."""
    directory = tmp_path_factory.mktemp("qwen3")
    save_qwen3(directory, qwen3_config(), seed=5)
    return directory


@pytest.fixture
def broken(checkpoint, tmp_path):
    directory = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, directory)
    return directory


def logits_of(model, input_ids):
    batch, length = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))

    @jax.jit
    def forward(ids):
        return model.logits(model(ids, positions, jnp.ones_like(ids)).hidden)

    return np.asarray(forward(input_ids))


def edit_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def rewrite_tensors(directory, edit):
    tensors = load_file(directory / WEIGHTS)
    edit(tensors)
    save_file(tensors, directory / WEIGHTS)


def load_error(directory) -> str:
    with pytest.raises(CheckpointError) as error:
        load_target(directory, param_dtype=jnp.float32)
    return str(error.value)


def test_load_target_dispatches_qwen3(checkpoint):
    model, config = load_target(checkpoint, param_dtype=jnp.float32)
    assert config.num_hidden_layers == 3 and not config.tie_word_embeddings
    assert model.layers.self_attn.q_proj.kernel[...].dtype == jnp.float32


def test_param_dtype_bfloat16(checkpoint):
    model, _ = load_target(checkpoint, param_dtype=jnp.bfloat16)
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert model.lm_head.kernel[...].dtype == jnp.bfloat16


def test_load_onto_mesh_shards_weights_and_keeps_logits(checkpoint):
    assert jax.device_count() == 8, "tests/conftest.py sets 8 host devices"
    input_ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (4, 33), dtype=np.int32))
    plain, _ = load_target(checkpoint, param_dtype=jnp.float32)
    mesh = make_mesh(1, 4, 2)
    sharded, _ = load_target(checkpoint, param_dtype=jnp.float32, mesh=mesh)
    q_kernel = sharded.layers.self_attn.q_proj.kernel[...]
    assert q_kernel.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    assert q_kernel.addressable_shards[0].data.shape == (3, 64 // 4, 4 * 24 // 2)
    assert sharded.lm_head.kernel[...].sharding.spec == PartitionSpec("fsdp", "tensor")
    np.testing.assert_allclose(logits_of(sharded, input_ids), logits_of(plain, input_ids), rtol=1e-5, atol=1e-5)


def test_tied_checkpoint_ignores_a_stray_lm_head(tmp_path):
    save_qwen3(tmp_path, qwen3_config(tie_word_embeddings=True), seed=6)
    input_ids = jnp.zeros((1, 9), jnp.int32)
    reference = logits_of(load_target(tmp_path, param_dtype=jnp.float32)[0], input_ids)
    rewrite_tensors(tmp_path, lambda t: t.update({"lm_head.weight": torch.randn(96, 64)}))
    model, config = load_target(tmp_path, param_dtype=jnp.float32)
    assert config.tie_word_embeddings
    np.testing.assert_array_equal(logits_of(model, input_ids), reference)


def test_missing_directory(tmp_path):
    assert "checkpoint directory not found" in load_error(tmp_path / "absent")
    assert "absent" in load_error(tmp_path / "absent")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    assert f"{broken / 'config.json'}: file not found" in load_error(broken)


def test_missing_weights_file(broken):
    (broken / WEIGHTS).unlink()
    assert "no model.safetensors or model.safetensors.index.json found" in load_error(broken)


def test_missing_shard_of_an_index(tmp_path):
    save_qwen3(tmp_path, qwen3_config(), seed=7, max_shard_size="20KB")
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    (tmp_path / shard).unlink()
    assert f"{tmp_path / shard}: file not found" in load_error(tmp_path)


def test_unsupported_model_type(broken):
    edit_config(broken, model_type="llama")
    message = load_error(broken)
    assert "unsupported model_type 'llama'" in message and "qwen3" in message


def test_invalid_config_field(broken):
    edit_config(broken, num_key_value_heads=3)
    message = load_error(broken)
    assert "config.json" in message and "'num_key_value_heads' (3)" in message


def test_tensor_with_wrong_shape(broken):
    rewrite_tensors(broken, lambda t: t.update({"model.layers.1.self_attn.k_norm.weight": torch.ones(26)}))
    message = load_error(broken)
    assert "tensor model.layers.1.self_attn.k_norm.weight has shape (26,), expected (24,)" in message


def test_transposed_tensor_shapes_are_reported_in_hf_layout(broken):
    edit_config(broken, intermediate_size=128)
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape (96, 64), expected (128, 64)" in load_error(broken)


def test_missing_tensors_are_listed(broken):
    def drop(tensors):
        del tensors["model.norm.weight"], tensors["model.layers.2.mlp.up_proj.weight"], tensors["lm_head.weight"]

    rewrite_tensors(broken, drop)
    message = load_error(broken)
    assert "missing tensors (3): lm_head.weight, model.layers.2.mlp.up_proj.weight, model.norm.weight" in message


def test_missing_layers_are_listed(broken):
    edit_config(broken, num_hidden_layers=4)
    assert "missing tensors (11): model.layers.3.input_layernorm.weight" in load_error(broken)


def test_unexpected_tensors_are_listed(broken):
    rewrite_tensors(broken, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(96),
                                                "mtp.fc.weight": torch.zeros(2, 2)}))
    message = load_error(broken)
    assert "unexpected tensors (2): model.layers.0.self_attn.q_proj.bias, mtp.fc.weight" in message
    assert "missing" not in message


def test_truncated_weights_file(broken):
    path = broken / WEIGHTS
    path.write_bytes(path.read_bytes()[:-1000])
    message = load_error(broken)
    assert str(path) in message and "truncated or corrupt" in message and "file not fully covered" in message


@pytest.mark.parametrize("content, reason", [
    (b"\x01\x02", "truncated or corrupt (2 bytes): Error while deserializing header: header too small"),
    ((10**9).to_bytes(8, "little") + b"{}", "header too large"),
    ((4).to_bytes(8, "little") + b"\xff{[}", "invalid UTF-8 in header"),
])
def test_corrupt_weights_file(broken, content, reason):
    (broken / WEIGHTS).write_bytes(content)
    message = load_error(broken)
    assert str(broken / WEIGHTS) in message and reason in message


def test_reader_reads_bf16_tensors_and_slices_of_them(tmp_path):
    """bf16 through the safetensors library's numpy reader (ml_dtypes' bfloat16), whole or a slice."""
    values = torch.randn(6, 5, dtype=torch.float32).to(torch.bfloat16)
    save_file({"w": values, "v": torch.arange(4, dtype=torch.int32)}, tmp_path / WEIGHTS)
    reader = CheckpointReader(tmp_path)
    assert reader.names() == ["v", "w"] and reader.shape("w") == (6, 5)
    whole = reader.read("w")
    assert whole.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(whole.astype(np.float32), values.float().numpy())
    np.testing.assert_array_equal(reader.read("w", (slice(2, 4), slice(1, 3))), whole[2:4, 1:3])
    np.testing.assert_array_equal(reader.read("v"), np.arange(4, dtype=np.int32))
