"""Drafter export (design §10): real files checked name by name and field by field, loaded strictly into the
independent PyTorch reference, imported back into NNX, and the export CLI's errors."""

from __future__ import annotations

import json
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from ml_collections import ConfigDict
from safetensors.torch import load_file

from dflash_jax.runtime.errors import CheckpointError, OutputDirError
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.runtime.workdir import append_config_history
from dflash_jax.weights.drafter_files import (drafter_config_from_zlab, drafter_from_torch_layout, drafter_to_torch_layout,
                                             export_drafter, load_drafter_dir, serve_command, zlab_config)
from tests.command import dflash_jax, user_error
from tests.drafter_fixtures import (BLOCK, CONFIGS, FULL, HIDDEN, MASK_ID, SEQ_LEN, SLIDING, VOCAB, forward,
                                    make_config, packed_rows, random_weights, relative_error)
from tests.torch_reference import ReferenceDrafter, block_ids, reference_logits
from tests.train_fixtures import training_workdir


# A YaRN drafter (a long-context recipe's): 4 positions scaled 4x, which the test rows reach 5x past.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 8, "beta_slow": 1}


def exported(tmp_path, kind: str, seed: int = 0, rope_scaling: dict | None = None):
    """(config, fp32 weights, JAX drafter holding them, export directory)."""
    config = make_config(*CONFIGS[kind], rope_scaling=rope_scaling)
    weights = random_weights(config, seed)
    drafter = drafter_from_torch_layout(weights, config, query_chunk_blocks=2)
    return config, weights, drafter, export_drafter(drafter, config, tmp_path / kind)


def safetensors_header(path) -> dict:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


@pytest.mark.parametrize("kind, rope_scaling", [*((kind, None) for kind in sorted(CONFIGS)), ("sliding_full", YARN)])
def test_export_loads_strictly_into_torch_reference_with_same_logits(tmp_path, kind, rope_scaling):
    """The export read by the PyTorch reference (its config.json's RoPE scaling included) and imported back."""
    config, _, drafter, out = exported(tmp_path, kind, rope_scaling=rope_scaling)
    reference = ReferenceDrafter(json.loads((out / "config.json").read_text()))
    state = {name: tensor.float() for name, tensor in load_file(out / "model.safetensors").items()}
    result = reference.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys

    features, input_ids, positions, segments = packed_rows(1, len(config.target_layer_ids))
    rng = np.random.default_rng(0)
    embed_tokens, lm_head = (rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) for _ in range(2))
    grid = AnchorGrid(SEQ_LEN, 4, BLOCK)
    with torch.no_grad():
        inputs = [torch.from_numpy(x) for x in (features, input_ids, positions, segments)]
        expected = reference_logits(reference, torch.from_numpy(embed_tokens), torch.from_numpy(lm_head), *inputs,
                                    grid.anchors.tolist(), MASK_ID).numpy()
    embeds = jnp.asarray(embed_tokens[block_ids(inputs[1], grid.anchors.tolist(), BLOCK, MASK_ID).numpy()])
    args = (jnp.asarray(features), embeds, jnp.asarray(positions), jnp.asarray(segments), grid)
    # The fp32 JAX drafter vs the bf16 export: bf16 weight rounding only.
    assert relative_error(forward(drafter, *args) @ lm_head.T, expected) < 2e-2
    # The export imported back into JAX computes what the reference computes from the same files.
    imported, imported_config = load_drafter_dir(out, query_chunk_blocks=2)
    assert imported_config.rope_scaling == config.rope_scaling
    assert relative_error(forward(imported, *args) @ lm_head.T, expected) < 1e-4


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_exported_names_shapes_dtypes_and_config_fields(tmp_path, kind):
    config, _, _, out = exported(tmp_path, kind)
    # The drafter files, and the ownership file that lets a later --overwrite replace them (output_dir.py).
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash_output.json", "model.safetensors"]
    header = safetensors_header(out / "model.safetensors")
    header.pop("__metadata__")
    heads, kv, hd, inner, n = 4, 2, 8, 64, len(config.target_layer_ids)
    expected = {"fc.weight": [HIDDEN, n * HIDDEN], "hidden_norm.weight": [HIDDEN], "norm.weight": [HIDDEN]}
    for i in range(config.num_hidden_layers):
        expected |= {f"layers.{i}.{name}": shape for name, shape in {
            "input_layernorm.weight": [HIDDEN], "post_attention_layernorm.weight": [HIDDEN],
            "self_attn.q_proj.weight": [heads * hd, HIDDEN], "self_attn.k_proj.weight": [kv * hd, HIDDEN],
            "self_attn.v_proj.weight": [kv * hd, HIDDEN], "self_attn.o_proj.weight": [HIDDEN, heads * hd],
            "self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd],
            "mlp.gate_proj.weight": [inner, HIDDEN], "mlp.up_proj.weight": [inner, HIDDEN],
            "mlp.down_proj.weight": [HIDDEN, inner]}.items()}
    assert {name: info["shape"] for name, info in header.items()} == expected
    assert {info["dtype"] for info in header.values()} == {"BF16"}

    written = json.loads((out / "config.json").read_text())
    sliding = kind == "sliding_full"
    assert written == {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "intermediate_size": inner, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 256,
        "vocab_size": VOCAB, "tie_word_embeddings": False, "layer_types": list(config.layer_types),
        "sliding_window": 5 if sliding else None, "use_sliding_window": sliding, "initializer_range": 0.02,
        "block_size": BLOCK, "num_target_layers": 12,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 5, 9], "block_size": BLOCK},
        "dtype": "bfloat16"}
    assert "eagle_aux_hidden_state_layer_ids" not in written


def test_rope_scaling_is_written_exactly_as_trained():
    config = make_config(rope_theta=1e7, rope_scaling={"rope_type": "default", "factor": 1.0})
    written = zlab_config(config)
    assert written["rope_theta"] == 1e7 and written["rope_scaling"] == {"rope_type": "default", "factor": 1.0}
    assert written["rope_parameters"] == {"rope_type": "default", "factor": 1.0, "rope_theta": 1e7}
    assert drafter_config_from_zlab(written) == config


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_export_then_import_is_the_identity_up_to_bf16(tmp_path, kind):
    config, weights, _, out = exported(tmp_path, kind, seed=3)
    drafter, loaded_config = load_drafter_dir(out)
    assert loaded_config == config
    tensors = drafter_to_torch_layout(drafter)
    assert tensors.keys() == weights.keys()
    for name, value in weights.items():
        rounded = value.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(tensors[name], rounded, err_msg=name)


@pytest.mark.parametrize("where", ["top_level", "dflash_config"])
def test_zlab_configs_with_block_size_in_one_place(where):
    config = make_config()
    raw = zlab_config(config)
    if where == "top_level":
        del raw["dflash_config"]["block_size"]
    else:
        del raw["block_size"]
    assert drafter_config_from_zlab(raw) == config


def test_published_style_config_without_rope_parameters_or_layer_types():
    """Older z-lab configs: top-level rope keys only, no layer_types (all full attention)."""
    raw = zlab_config(make_config())
    for key in ("rope_parameters", "layer_types", "use_sliding_window", "sliding_window"):
        del raw[key]
    assert drafter_config_from_zlab(raw) == make_config()


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(block_size=8), r"block_size .* got 8 and dflash_config.block_size 4"),
    (lambda c: (c.pop("block_size"), c["dflash_config"].pop("block_size")), r"block_size must be given"),
    (lambda c: c.pop("head_dim"), r"missing field\(s\) head_dim"),
    (lambda c: c.update(model_type="llama"), r"model_type 'llama' is not 'qwen3'"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), r"no mask_token_id"),
    (lambda c: c["dflash_config"].update(causal=True), r"dflash_config.causal=True forces every layer causal"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 5, 9]), r"is not dflash_config.target_layer_ids \+ 1"),
    (lambda c: c.update(num_target_layers=4), r"target_layer_ids \[1, 5, 9\] has ids \[5, 9\] outside"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path, edit, message):
    raw = zlab_config(make_config((SLIDING, FULL), 5))
    edit(raw)
    with pytest.raises(CheckpointError, match=message):
        drafter_config_from_zlab(raw, tmp_path / "config.json")


def test_import_refuses_missing_extra_and_misshapen_tensors(tmp_path):
    from safetensors.numpy import load_file as load_numpy, save_file
    _, _, _, out = exported(tmp_path, "all_full")
    tensors = load_numpy(out / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"} | {"lm_head.weight": tensors["fc.weight"]},
              str(out / "model.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"all_full: .*missing \['norm.weight'\], unexpected \['lm_head.weight'\]"):
        load_drafter_dir(out)
    save_file(tensors | {"layers.0.mlp.up_proj.weight": tensors["layers.0.mlp.down_proj.weight"]},
              str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.up_proj.weight has shape \(32, 64\), expected \(64, 32\)"):
        load_drafter_dir(out)


def test_export_refuses_non_empty_directory_unless_overwrite(tmp_path):
    config, weights, drafter, out = exported(tmp_path, "all_full")
    with pytest.raises(OutputDirError, match=r"all_full: output directory is not empty"):
        export_drafter(drafter, config, out)
    export_drafter(drafter, config, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash_output.json", "model.safetensors"]
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")  # vLLM would read it: refused, kept
    with pytest.raises(OutputDirError, match=r"it also holds model-00002-of-00002.safetensors"):
        export_drafter(drafter, config, out, overwrite=True)
    assert (out / "model-00002-of-00002.safetensors").read_bytes() == b"stale"
    with pytest.raises(ValueError, match="the drafter was built with"):
        export_drafter(drafter, make_config(block_size=8), tmp_path / "other")


@pytest.mark.parametrize("ids", [(1, 1, 9), (9, 5, 1)])
def test_export_refuses_feature_layers_vllm_would_reorder(tmp_path, ids):
    """vLLM feeds fc the target layers sorted(set(ids)): repeated or unsorted ids cannot be served."""
    from flax import nnx

    from dflash_jax.models.drafter import Drafter
    config = make_config(target_layer_ids=ids)
    with pytest.raises(ValueError, match=r"target_layer_ids \[.*\] must be strictly increasing"):
        export_drafter(Drafter(config, rngs=nnx.Rngs(0)), config, tmp_path / "out")


def test_export_cli_restores_the_latest_or_a_given_step(tmp_path):
    workdir, config, weights = training_workdir(tmp_path)
    for args, step in (([], 4), (["--step", "2"], 2)):
        out = tmp_path / f"export{step}"
        result = dflash_jax("export", "--workdir", str(workdir), "--out", str(out), *args)
        assert result.returncode == 0, result.stderr[-3000:]
        printed = result.stdout
        assert f"exported step {step} of {workdir}" in printed
        assert ("vllm serve /ckpt/target --speculative-config "
                f"'{{\"method\":\"dflash\",\"model\":\"{out}\",\"num_speculative_tokens\":{BLOCK - 1}}}'") in printed
        # A mixed sliding/full drafter: vLLM TPU refuses it, SGLang-JAX serves it with its window.
        assert "on TPUs: vLLM TPU 0.32 ignores layer_types and sliding_window: it refuses this drafter" in printed
        assert f"  SGL_JAX_DFLASH_DRAFT_PREFIX_WINDOW={config.sliding_window} python -m sgl_jax.launch_server" in printed
        drafter, loaded_config = load_drafter_dir(out)
        assert loaded_config == config
        for name, tensor in drafter_to_torch_layout(drafter).items():
            rounded = weights[step][name].astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(tensor, rounded, err_msg=name)


@pytest.mark.parametrize("layers, runner", [("sliding_full", ["VLLM_USE_V2_MODEL_RUNNER=1"]), ("all_full", [])])
def test_serve_command_selects_vllms_v2_runner_for_a_mixed_drafter(layers, runner):
    import shlex

    config = make_config(*CONFIGS[layers])
    words = shlex.split(serve_command("Qwen/Qwen3.6-27B", "/ckpt/drafter", config))
    assert words[:-1] == runner + ["vllm", "serve", "Qwen/Qwen3.6-27B", "--speculative-config"]
    assert json.loads(words[-1]) == {"method": "dflash", "model": "/ckpt/drafter",
                                     "num_speculative_tokens": config.block_size - 1}


def test_export_cli_errors(tmp_path):
    workdir, _, _ = training_workdir(tmp_path)

    def error(*args) -> str:
        return user_error(dflash_jax("export", *args))

    assert f"{workdir}/checkpoints: no checkpoint at step 3; available steps: 2, 4" in error(
        "--workdir", str(workdir), "--out", str(tmp_path / "a"), "--step", "3")
    out = tmp_path / "taken"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    assert f"{out}: output directory is not empty (pass --overwrite" in error(
        "--workdir", str(workdir), "--out", str(out))
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "drafter_config.json").write_text((workdir / "drafter_config.json").read_text())
    assert f"{empty}/checkpoints: no checkpoint found" in error("--workdir", str(empty), "--out", str(tmp_path / "b"))
    assert f"{tmp_path}/nowhere/drafter_config.json: not found" in error(
        "--workdir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c"))


def test_export_writes_a_model_card_whose_commands_parse(tmp_path):
    """The card names the run's target, data and step, the last logged exact/DDTree τ, and serve commands
    that parse: vLLM's speculative config as JSON, SGLang's flags. With --push_to_hub and no network (here:
    HF_HUB_OFFLINE=1) everything up to the upload happens and the upload is one error line."""
    import argparse
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    workdir, config, _ = training_workdir(tmp_path)
    append_config_history(workdir, ConfigDict({"target_dir": "Qwen/Qwen3-8B", "eval_continuation": "generate",
                                               "eval_max_new_tokens": 256,
                                               "data": {"train_files": ["/data/train.jsonl"], "seq_len": 32768}}),
                          step=0)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 2, "eval/tau": 1.5, "eval/tau_per_response": 1.6, "eval/ddtree_tau_8": 1.7,
         "eval/ddtree_tau_22": 1.9, "eval/ddtree_tau_per_response_8": 1.8},
        {"step": 4, "loss": 3.0}, {"step": 6, "eval/tau": 9.9})))  # step 6 is after the exported step 4
    out = tmp_path / "export"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"HF_HUB_OFFLINE": "1"}
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "convert/export_drafter.py", "--workdir", str(workdir), "--out", str(out),
                          "--push_to_hub", "my-org/qwen3-8b-dflash"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 2
    (error,) = run.stderr.strip().splitlines()[-1:]
    assert error.startswith(f"error: pushing {out} to the Hub repo 'my-org/qwen3-8b-dflash' failed")
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: Qwen/Qwen3-8B\n")
    for fact in ("`Qwen/Qwen3-8B`", "`/data/train.jsonl`", "| training steps | 4 |", f"| block size | {BLOCK} |",
                 f"{list(config.target_layer_ids)}", "exact τ 1.500 (per-response mean 1.600); DDTree τ 1.700 at 8 nodes, 1.900 at 22 nodes (step 2",
                 "on the target's greedy continuations of up to 256 tokens)",
                 "| trained context | rows of 32,768 tokens", f"| RoPE | θ {config.rope_theta:g}; sliding window "):
        assert fact in card, fact
    commands = [block.split("```")[0].strip() for block in card.split("```bash\n")[1:]]
    vllm, sglang, _ = (shlex.split(command) for command in commands)  # the third: TPUs (test_tpu_serving.py)
    # The drafter mixes sliding and full layers: vLLM serves it with its V2 model runner only.
    assert vllm[:4] == ["VLLM_USE_V2_MODEL_RUNNER=1", "vllm", "serve", "Qwen/Qwen3-8B"]
    assert vllm[4] == "--speculative-config"
    assert json.loads(vllm[5]) == {"method": "dflash", "model": "my-org/qwen3-8b-dflash",
                                   "num_speculative_tokens": BLOCK - 1}
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--speculative-num-draft-tokens", type=int, required=True)
    parsed = parser.parse_args(sglang[3:])
    assert (parsed.model_path, parsed.speculative_algorithm, parsed.speculative_draft_model_path,
            parsed.speculative_num_draft_tokens) == ("Qwen/Qwen3-8B", "DFLASH", "my-org/qwen3-8b-dflash", BLOCK)
