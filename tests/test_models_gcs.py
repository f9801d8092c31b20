"""Model directories in a bucket (fake-gcs-server on loopback, tests/gcs_fixture.py; design §7.1): an Orbax target
(`dflash-jax convert` output) restores from gs:// onto a mesh with its arrays read in place, only its small
files copied to the local cache; `config.drafter.init_from` at a gs:// URL starts training from the exported
weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from dflash_jax.models.drafter import Drafter
from dflash_jax.paths import cached_path
from dflash_jax.sharding import make_mesh
from dflash_jax.weights.drafter_files import drafter_to_torch_layout, export_drafter
from dflash_jax.weights.orbax_target import MARKER_FILE, PARAMS_DIR, write_orbax_target
from dflash_jax.train import validate
from dflash_jax.train.state import init_train_state, state_spec
from dflash_jax.weights.targets import load_target, read_target_config
from tests.gcs_fixture import gcs_server
from tests.hf_fixtures import qwen3_config, save_qwen3
from tests.train_fixtures import make_target, mesh_of, tiny_config, write_corpus


def test_an_orbax_target_in_a_bucket_restores_shard_by_shard_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    save_qwen3(tmp_path / "hf", qwen3_config(), seed=1)
    write_orbax_target(tmp_path / "hf", tmp_path / "orbax", dtype=jnp.float32, progress=False)
    with gcs_server() as fs:
        fs.mkdir("models")
        fs.put(str(tmp_path / "orbax"), "models/orbax", recursive=True)
        restored, _ = load_target("gs://models/orbax", param_dtype=jnp.float32, mesh=make_mesh(fsdp=4, tensor=2))
    direct, _ = load_target(tmp_path / "hf", param_dtype=jnp.float32)
    direct_vars = dict(nnx.to_flat_state(nnx.state(direct)))  # (the local Orbax target's logits: test_hf_to_orbax)
    for path, variable in nnx.to_flat_state(nnx.state(restored)):
        value = variable.get_value()
        assert len(value.addressable_shards) == 8, path
        np.testing.assert_array_equal(np.asarray(value), np.asarray(direct_vars.pop(path).get_value()), str(path))
    assert not direct_vars
    copy = cached_path("gs://models/orbax")
    assert (copy / MARKER_FILE).is_file() and not (copy / PARAMS_DIR).exists()


def test_init_from_a_drafter_in_a_bucket_starts_from_its_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    files = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl", count=8)
    config = tiny_config(*files)
    drafter_config = validate.resolve_drafter_config(config, read_target_config(config.target_dir),
                                                     AutoTokenizer.from_pretrained(config.target_dir))
    source = Drafter(drafter_config, rngs=nnx.Rngs(7))
    export_drafter(source, drafter_config, tmp_path / "export")
    config.drafter.init_from = "gs://models/drafter"
    spec = state_spec(drafter_config, config, "xla", mesh_of())
    with gcs_server() as fs:
        fs.mkdir("models")
        fs.put(str(tmp_path / "export"), "models/drafter", recursive=True)
        state = init_train_state(drafter_config, config, "xla", spec)  # as `train` starts a run
    loaded = drafter_to_torch_layout(nnx.merge(spec.graphdef, state.params))
    for name, value in drafter_to_torch_layout(source).items():  # the export is bf16
        np.testing.assert_array_equal(loaded[name], np.asarray(jnp.asarray(value, jnp.bfloat16), np.float32))
