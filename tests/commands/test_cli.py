"""The `dflash-jax` command: every subcommand's --help, --print_config, user errors as one line with exit
code 2, and a tiny end to end job (train -> export) through the console script, the same as `make demo`
runs with the toy target."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.commands.cli import COMMANDS
from dflash_jax.train.checkpoint import restore_drafter
from dflash_jax.weights.drafter_files import load_drafter_dir
from tests.command import dflash_jax, user_error
from tests.train_fixtures import make_target, write_corpus

TINY = "configs/tiny.py"


# One command's help in make test; the others (a fresh interpreter each) in make test-slow.
@pytest.mark.parametrize("command", [command if command == "train" else pytest.param(command, marks=pytest.mark.slow)
                                     for command in sorted(COMMANDS)])
def test_every_command_has_help_naming_where_the_config_fields_are(command):
    result = dflash_jax(command, "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"usage: dflash-jax {command} [flags]")
    assert "dflash_jax/train/config.py" in result.stdout
    # The command's own flags are listed, e.g. export's --out.
    own_flag = {"regenerate": "--prompts", "train": "--workdir", "evaluate": "--drafter", "export": "--out",
                "convert": "--hf_dir", "plan": "--topology"}
    assert own_flag[command] in result.stdout


def test_overview_and_unknown_command():
    result = dflash_jax("--help")
    assert result.returncode == 0 and all(name in result.stdout for name in COMMANDS)
    assert user_error(dflash_jax("trian")) == ("error: unknown command 'trian'; the commands are regenerate, train, "
                                               "evaluate, export, convert, plan (see dflash-jax --help)")


def test_print_config_shows_the_file_with_its_overrides():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    result = dflash_jax("train", "--config", TINY, "--workdir", "unused", "--config.drafter.block_size=4",
                        "--config.drafter.num_hidden_layers=3", f"--config.drafter.rope_scaling={json.dumps(yarn)}",
                        "--print_config")
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads(result.stdout)
    assert (config["drafter"]["block_size"], config["drafter"]["num_hidden_layers"], config["data"]["seq_len"]) == (
        4, 3, 128)
    assert config["drafter"]["rope_scaling"] == yarn  # a dict field takes JSON (or a Python dict literal)
    from dflash_jax.commands.cli import _DictParser

    assert _DictParser().parse("{'rope_type': 'linear', 'factor': 2.0}") == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="expected a dict"):
        _DictParser().parse("yarn")
    assert config["choose_mesh"] is None  # no --config.mesh.* flag: chosen on accelerators when left at defaults


def test_a_mesh_given_on_the_command_line_is_used_as_given_even_at_its_default_values():
    """`--config.mesh.fsdp=-1` is the default value, but given: the run uses it rather than choosing a mesh."""
    from dflash_jax.planning.compare import chooses_mesh
    from dflash_jax.train.config import base_config

    result = dflash_jax("train", "--config", TINY, "--workdir", "unused", "--config.mesh.fsdp=-1", "--print_config")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["choose_mesh"] is False
    config = base_config()
    assert chooses_mesh(config)
    config.choose_mesh = False
    assert not chooses_mesh(config)
    config.choose_mesh, config.mesh.tensor = True, 2
    assert chooses_mesh(config)  # chosen although the recipe set a mesh


# slow: a fresh interpreter importing the package outside the checkout (make test's budget)
@pytest.mark.slow
def test_a_packaged_recipe_is_named_without_its_path(tmp_path):
    """`--config qwen27b` is the installed package's copy of configs/qwen27b.py (dflash_jax.configs), so an
    installed dflash-jax has the recipes; run from elsewhere than the repository, as a pip user would."""
    import subprocess

    from configs import qwen27b
    from dflash_jax.commands.cli import packaged_config_path
    from dflash_jax.runtime.errors import UserError
    from tests.command import SCRIPT

    by_name = subprocess.run([str(SCRIPT), "train", "--config", "qwen27b", "--workdir", "x", "--print_config"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert by_name.returncode == 0, by_name.stderr[-3000:]
    assert json.loads(by_name.stdout) == json.loads(qwen27b.get_config().to_json_best_effort())
    assert packaged_config_path("configs/qwen27b.py") == "configs/qwen27b.py"  # a path stays a path
    with pytest.raises(UserError, match=r"^--config qwen28b: no such file, nor a packaged config \(those are: "
                                        r"qwen27b, qwen27b_dflash2, qwen27b_dspark, qwen27b_long, qwen36_35b_a3b, "
                                        r"qwen36_35b_a3b_long, qwen3_30b_a3b, qwen3_8b, tiny, toy\)$"):
        packaged_config_path("qwen28b")


def test_user_errors_are_one_line_with_exit_code_2(tmp_path):
    assert "--workdir" in user_error(dflash_jax("train", "--config", TINY))
    assert "stray" in user_error(dflash_jax("export", "--workdir", str(tmp_path), "--out", "x", "stray"))
    workdir = tmp_path / "run"
    assert user_error(dflash_jax("export", "--workdir", str(workdir), "--out", str(tmp_path / "out"))) == (
        f"error: {workdir}/drafter_config.json: not found; is {workdir} a training workdir?")


@pytest.mark.slow  # two commands through the console script, ~30 s; make demo's test runs the same path
def test_train_then_export_through_the_console_script(tmp_path):
    target_dir, corpus = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl", count=40)
    workdir, out = tmp_path / "run", tmp_path / "export"
    trained = dflash_jax("train", "--config", TINY, "--workdir", str(workdir), f"--config.target_dir={target_dir}",
                         f"--config.data.train_files={corpus}", "--config.data.seq_len=64",
                         "--config.drafter.sliding_window=24",
                         "--config.total_steps=2", "--config.log_every=1", "--config.mesh.fsdp=1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    exported = dflash_jax("export", "--workdir", str(workdir), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"exported step 2 of {workdir} to {out}" in exported.stdout
    assert f"vllm serve {target_dir} --speculative-config" in exported.stdout
    drafter, config, _ = restore_drafter(workdir, None)
    loaded, loaded_config = load_drafter_dir(out)
    assert loaded_config == config
    for (path, ours), (_, theirs) in zip(nnx.to_flat_state(nnx.state(drafter, nnx.Param)),
                                        nnx.to_flat_state(nnx.state(loaded, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(ours[...].astype(jnp.bfloat16).astype(jnp.float32)),
                                      np.asarray(theirs[...]), err_msg=str(path))
