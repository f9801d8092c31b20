"""HF target -> Orbax target (convert/hf_to_orbax.py) -> restored target: the same logits as loading the HF
directory directly, on one device and on an 8-device (fsdp=4, tensor=2) mesh; and the converter's errors."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from orbax.checkpoint import v1 as ocp
from safetensors.numpy import load_file, save_file

from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.runtime.paths import cached_path
from dflash_jax.weights.targets import load_target
from dflash_jax.sharding import make_mesh, state_shardings
from dflash_jax.weights.orbax_target import MARKER_FILE, PARAMS_DIR, write_orbax_target
from tests.command import dflash_jax, user_error
from tests.hf_fixtures import (QWEN3_5_TEXT_CONFIG, fuse_experts, qwen3_config, randomize_qwen3_5, save_qwen3,
                               save_qwen3_5_moe)


@nnx.jit
def logits_and_features(model, ids):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    out = model(ids, positions, jnp.zeros_like(ids), (0, 1))
    return model.logits(out.hidden), out.features


def assert_same_model(restored, direct):
    """Identical variables (names, dtypes, values) and the same logits/features (up to the reduction order
    of a sharded forward)."""
    restored_vars = dict(nnx.to_flat_state(nnx.state(restored)))
    direct_vars = dict(nnx.to_flat_state(nnx.state(direct)))
    assert restored_vars.keys() == direct_vars.keys()
    for path, variable in direct_vars.items():
        value = restored_vars[path].get_value()
        assert value.dtype == variable.get_value().dtype, path
        np.testing.assert_array_equal(np.asarray(value, np.float32), np.asarray(variable.get_value(), np.float32),
                                      err_msg=str(path))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 37)), jnp.int32)
    for got, want in zip(logits_and_features(restored, ids), logits_and_features(direct, ids)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    """A random HF Qwen3 (untied) and a tied one, each with its Orbax conversion (fp32 and bf16)."""
    root = tmp_path_factory.mktemp("qwen3")
    for name, tied in (("untied", False), ("tied", True)):
        save_qwen3(root / name, qwen3_config(tie_word_embeddings=tied), seed=1)
        (root / name / "tokenizer.json").write_text("{}")  # stands in for the tokenizer files
        for dtype in ("float32", "bfloat16"):
            write_orbax_target(root / name, root / f"{name}_{dtype}", dtype=jnp.dtype(dtype), progress=False)
    return root


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_orbax_target_equals_hf_target(qwen3_dirs, name):
    restored, restored_config = load_target(qwen3_dirs / f"{name}_float32", param_dtype=jnp.float32)
    direct, direct_config = load_target(qwen3_dirs / name, param_dtype=jnp.float32)
    assert restored_config == direct_config
    assert_same_model(restored, direct)
    copied = sorted(p.name for p in (qwen3_dirs / f"{name}_float32").iterdir())
    assert copied == ["config.json", "dflash_output.json", MARKER_FILE, "generation_config.json", "params",
                      "tokenizer.json"]


def test_a_stacked_variable_is_stored_one_array_per_layer(qwen3_dirs):
    """The conversion writes a layer at a time (host memory: one layer's tensors), so each layer of a stacked
    variable is an array of its own; the restore puts them back in their stack (the test above)."""
    stored = ocp.metadata(qwen3_dirs / "untied_float32" / PARAMS_DIR).metadata
    up_proj = {name: tuple(array.shape) for name, array in stored.items() if name.startswith("layers.mlp.up_proj")}
    assert up_proj == {f"layers.mlp.up_proj.kernel#{layer}": (64, 96) for layer in range(3)}
    assert tuple(stored["embed_tokens.embedding"].shape) == (96, 64)


def test_bf16_storage_equals_hf_loaded_in_bf16(qwen3_dirs):
    restored, _ = load_target(qwen3_dirs / "untied_bfloat16", param_dtype=jnp.bfloat16)
    direct, _ = load_target(qwen3_dirs / "untied", param_dtype=jnp.bfloat16)
    assert_same_model(restored, direct)
    marker = json.loads((qwen3_dirs / "untied_bfloat16" / MARKER_FILE).read_text())
    assert marker["dtype"] == "bfloat16" and marker["model_type"] == "qwen3"


def test_restore_onto_an_8_device_mesh_shard_by_shard(qwen3_dirs):
    mesh = make_mesh(fsdp=4, tensor=2)
    restored, _ = load_target(qwen3_dirs / "untied_float32", param_dtype=jnp.float32, mesh=mesh)
    expected = dict(nnx.to_flat_state(state_shardings(nnx.state(restored), mesh)))
    for path, variable in nnx.to_flat_state(nnx.state(restored)):
        value = variable.get_value()
        assert value.sharding == expected[path].get_value(), path
        assert len(value.addressable_shards) == 8
    kernel = restored.layers.mlp.up_proj.kernel.get_value()  # [layers, embed/fsdp, mlp/tensor]
    assert kernel.addressable_shards[0].data.shape == (3, 64 // 4, 96 // 2)
    direct, _ = load_target(qwen3_dirs / "untied", param_dtype=jnp.float32)
    assert_same_model(restored, direct)


def test_an_orbax_target_in_a_bucket_restores_shard_by_shard_in_place(qwen3_dirs, tmp_path, monkeypatch):
    """Its small files copied to the local cache, its arrays read from the bucket (fake-gcs-server on loopback;
    design §7.1)."""
    gcs_server = pytest.importorskip("tests.gcs_fixture").gcs_server
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    with gcs_server() as fs:
        fs.mkdir("models")
        fs.put(str(qwen3_dirs / "untied_float32"), "models/orbax", recursive=True)
        restored, _ = load_target("gs://models/orbax", param_dtype=jnp.float32, mesh=make_mesh(fsdp=4, tensor=2))
    local, _ = load_target(qwen3_dirs / "untied_float32", param_dtype=jnp.float32)
    local_vars = dict(nnx.to_flat_state(nnx.state(local)))  # (its logits equal the HF target's: above)
    for path, variable in nnx.to_flat_state(nnx.state(restored)):
        value = variable.get_value()
        assert len(value.addressable_shards) == 8, path
        np.testing.assert_array_equal(np.asarray(value), np.asarray(local_vars.pop(path).get_value()), str(path))
    assert not local_vars
    copy = cached_path("gs://models/orbax")
    assert (copy / MARKER_FILE).is_file() and not (copy / PARAMS_DIR).exists()


def test_qwen3_5_target(tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**(QWEN3_5_TEXT_CONFIG | {"vocab_size": 96}))).eval()
    randomize_qwen3_5(model, seed=0)
    model.save_pretrained(tmp_path / "hf")
    write_orbax_target(tmp_path / "hf", tmp_path / "orbax", dtype=jnp.bfloat16, progress=False)
    restored, _ = load_target(tmp_path / "orbax", param_dtype=jnp.float32)
    layer = restored.periods.layers[0].linear_attn
    assert layer.A_log.dtype == jnp.float32  # fp32 in the model whatever the storage dtype
    direct, _ = load_target(tmp_path / "hf", param_dtype=jnp.bfloat16)
    direct_as_fp32 = jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(direct))
    nnx.update(direct, direct_as_fp32)
    assert_same_model(restored, direct)


@pytest.mark.slow  # 7-13 s: Orbax saves each of the ~90 stacked variables on its own
@pytest.mark.parametrize("fused", [False, True])
def test_qwen3_5_moe_target(tmp_path, fused):
    """Experts per expert (stacked [layers, E, ...] while converting) or fused (the published layout)."""
    save_qwen3_5_moe(tmp_path / "hf", seed=0)
    hf_dir = fuse_experts(tmp_path / "hf", tmp_path / "fused") if fused else tmp_path / "hf"
    write_orbax_target(hf_dir, tmp_path / "orbax", dtype=jnp.float32, progress=False)
    restored, config = load_target(tmp_path / "orbax", param_dtype=jnp.float32)
    assert config.moe.num_experts == 6 and restored.periods.layers[0].mlp.experts.up_proj.shape == (1, 6, 32, 16)
    direct, _ = load_target(hf_dir, param_dtype=jnp.float32)
    assert_same_model(restored, direct)


def test_converter_names_a_missing_expert_tensor(tmp_path):
    """One line naming the tensor (the command prints a CheckpointError as it is: test_converter_errors)."""
    save_qwen3_5_moe(tmp_path / "hf", seed=0)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.5.gate_proj.weight"]
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        write_orbax_target(tmp_path / "hf", tmp_path / "out", progress=False)
    assert str(error.value) == (f"{tmp_path / 'hf'}: missing tensors ['model.layers.3.mlp.experts.5.gate_proj.weight'], "
                                "unexpected tensors []")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_converter_errors(qwen3_dirs, tmp_path):
    def convert(*args):
        return dflash_jax("convert", "--hf_dir", *args)

    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    assert "out: output directory is not empty (pass --overwrite" in user_error(convert(str(qwen3_dirs / "untied"),
                                                                                       "--out", str(out)))
    assert "--overwrite refused: it has no dflash_output.json" in user_error(
        convert(str(qwen3_dirs / "untied"), "--out", str(out), "--overwrite"))
    assert (out / "something").read_text() == "x"

    bad = tmp_path / "llama"
    shutil.copytree(qwen3_dirs / "untied", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    assert "llama/config.json: unsupported model_type 'llama'" in user_error(convert(str(bad), "--out",
                                                                                   str(tmp_path / "o1")))
    (bad / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 4}))
    assert "missing tensors ['model.layers.3.input_layernorm.weight'" in user_error(convert(str(bad), "--out",
                                                                                         str(tmp_path / "o2")))


def test_restore_refuses_a_config_that_does_not_match_the_arrays(qwen3_dirs, tmp_path):
    copy = shutil.copytree(qwen3_dirs / "untied_float32", tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    with pytest.raises(CheckpointError, match=r"wrong shapes \['layers.mlp.down_proj.kernel \(3, 96, 64\) "
                                              r"\(config.json needs \(3, 128, 64\)\)'"):
        load_target(copy)
    (copy / MARKER_FILE).write_text(json.dumps({"format": "dflash_jax.orbax_target", "version": 99}))
    with pytest.raises(CheckpointError, match=r"version 99, expected 'dflash_jax.orbax_target' version 3"):
        load_target(copy)
