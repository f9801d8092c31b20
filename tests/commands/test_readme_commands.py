"""The commands of the README and of its guides under docs/ run as written. Every `dflash-jax` command parses
with that command's own flags (a flag renamed or removed fails here), and every training, plan and launch command
validates on the devices it names: its config file and overrides parse as the command line parses them, and the
config, the mesh and the batch pass the start-up checks for that device count (the point where a run would start
loading weights, or a plan compiling), so a guide that drifts from the configs fails here rather than on a slice
that was just created."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from absl import flags

from dflash_jax.commands.cli import COMMANDS as CLI_COMMANDS, define_config_flag, packaged_config_path
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.sharding import BATCH_AXES
from dflash_jax.train.validate import settle_batch_size, validate_config

REPO = Path(__file__).resolve().parents[2]
GPUS_PER_HOST = 8  # a GPU host of the README's commands; launch/slurm.sbatch asks Slurm for as many per node
COMMANDS = ("dflash-jax train", "dflash-jax plan", "launch/tpu_pod.sh", "sbatch", "launch/gpu.sh", "launch/tpu_vm.sh")


def bash_lines() -> list[str]:
    """The bash lines of the README and the guides under docs/, continuation lines joined (a trailing comment
    dropped)."""
    blocks = [b for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
              for b in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)]
    lines = [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [line.split(" #")[0].strip() for line in lines]


def readme_commands() -> list[str]:
    """The lines that start a training run or plan one."""
    return [line for line in bash_lines() if line.startswith(COMMANDS)]


def dflash_jax_commands() -> list[str]:
    """Every `dflash-jax <command>` line."""
    return [line for line in bash_lines() if line.startswith("dflash-jax ")]


def chips_of(tpu_type: str) -> int:
    """Chips of a Cloud TPU type: v5p-N and v4-N count TensorCores (2 a chip), v5e/v6e count chips."""
    generation, count = tpu_type.rsplit("-", 1)
    return int(count) // 2 if generation in ("v4", "v5p") else int(count)


def topology_chips(topology: str) -> int:
    """Devices of a `dflash-jax plan --topology`: a Cloud TPU type, gpu:<chip>x<per host>x<hosts>, or cpu:N."""
    if topology.startswith("gpu:"):
        per_host, hosts = topology.split("x")[-2:]
        return int(per_host) * int(hosts)
    return int(topology.split(":")[1]) if topology.startswith("cpu:") else chips_of(topology)


def parsed(words: list[str]) -> tuple[str, list[str], int]:
    """(config file, its --config.* overrides, devices) of one README command; a plan's --mesh sizes become
    --config.mesh.* overrides."""
    if words[0] == "sbatch":
        nodes = int(next(w.split("=", 1)[1] for w in words if w.startswith("--nodes=")))
        assert f"#SBATCH --gpus-per-node={GPUS_PER_HOST}" in (REPO / "launch" / "slurm.sbatch").read_text()
        rest = words[words.index("launch/slurm.sbatch") + 1:]
        return rest[0], rest[2:], nodes * GPUS_PER_HOST
    if words[0] == "launch/tpu_pod.sh":
        devices = chips_of(words[words.index("--type") + 1])
        rest, i = [], 3  # after `launch/tpu_pod.sh run NAME`: its options, then CONFIG WORKDIR overrides
        while i < len(words):
            if words[i] in ("--zone", "--type", "--version", "--project", "--setup"):
                i += 2
                continue
            if not words[i].startswith("--") or words[i].startswith("--config."):
                rest.append(words[i])
            i += 1
        return rest[0], rest[2:], devices
    if words[0] in ("launch/gpu.sh", "launch/tpu_vm.sh"):
        return words[1], words[3:], GPUS_PER_HOST
    if words[:2] == ["dflash-jax", "plan"]:
        mesh = words[words.index("--mesh") + 1].split(",") if "--mesh" in words else []
        # A plan reads the target's architecture from the config file and no data: the paths train would need
        # stand in, so the rest validates as train's start-up does.
        overrides = [f"--config.mesh.{size}" for size in mesh] + [w for w in words if w.startswith("--config.")] + [
            "--config.target_dir=/plan/target", "--config.data.train_files=/plan/train.jsonl"]
        return words[words.index("--config") + 1], overrides, topology_chips(words[words.index("--topology") + 1])
    # dflash-jax train --config FILE --workdir DIR overrides
    config = words[words.index("--config") + 1]
    return config, [w for w in words if w.startswith("--config.")], GPUS_PER_HOST


def check(command: str) -> None:
    """Raises ConfigError (or a flag error) if `command` would stop at start-up validation."""
    config_file, overrides, devices = parsed(shlex.split(command))
    path = packaged_config_path(config_file)
    path = path if Path(path).is_absolute() else str(REPO / path)
    flag_values = flags.FlagValues()
    holder = define_config_flag(flag_values)
    argv = ["train", "--config", path, *overrides]
    with mock.patch.object(sys, "argv", argv):  # ml_collections finds the --config.* overrides in sys.argv
        flag_values(argv)
    config = holder.value
    validate_config(config)
    sizes = dict(config.mesh)
    known = int(np.prod([size for size in sizes.values() if size != -1]))
    if -1 in sizes.values():
        if devices % known:
            raise ConfigError(f"config.mesh {sizes} does not divide {devices} devices")
        sizes = {axis: devices // known if size == -1 else size for axis, size in sizes.items()}
    elif known != devices:
        raise ConfigError(f"config.mesh {sizes} uses {known} of the {devices} devices")
    batch_shards = int(np.prod([sizes[axis] for axis in BATCH_AXES]))
    settle_batch_size(config, batch_shards)


def test_the_readme_has_training_and_launch_commands():
    starts = {next(prefix for prefix in COMMANDS if line.startswith(prefix)) for line in readme_commands()}
    assert {"dflash-jax train", "dflash-jax plan", "launch/tpu_pod.sh", "sbatch"} <= starts


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_validates_on_the_devices_it_names(command):
    check(command)


def fresh_flags(module_name: str) -> flags.FlagValues:
    """The flags of the command module, defined anew (its module is run again under another name, outside
    sys.modules), so that parsing them leaves the imported command's flags as they were."""
    spec = importlib.util.find_spec(module_name)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(f"{module_name}_fresh", spec.origin))
    module.__spec__.loader.exec_module(module)
    return module.FLAGS


def parse_flags(command: str) -> None:
    """Parses `command` (a `dflash-jax` line; `[--flag VALUE]` marks an optional flag whose value is a placeholder:
    only its name is checked) with its command's own flags, as `dflash-jax` would; raises on an unknown command or
    flag, or a value that does not parse."""
    optional = re.findall(r"\[--(\w+)[^]]*\]", command)
    words = shlex.split(re.sub(r"\[--\w+[^]]*\]", " ", command))
    assert words[1] in CLI_COMMANDS, f"{words[1]!r} is not a dflash-jax command"
    flag_values = fresh_flags(CLI_COMMANDS[words[1]])
    assert set(optional) <= set(flag_values), f"unknown flags {set(optional) - set(flag_values)}"
    if "--config" in words:
        i = words.index("--config") + 1
        path = packaged_config_path(words[i])  # a packaged recipe's name, as the command resolves it
        words[i] = path if Path(path).is_absolute() else str(REPO / path)
    argv = [f"dflash-jax {words[1]}", *words[2:]]
    with mock.patch.object(sys, "argv", argv):  # ml_collections finds the --config.* overrides in sys.argv
        rest = flag_values(argv)
    assert rest == argv[:1], f"arguments that are not flags: {rest[1:]}"
    if "--config" in words:
        flag_values.config.keys()  # the config file loads with its overrides


def test_the_guides_run_every_command():
    assert {line.split()[1] for line in dflash_jax_commands()} == set(CLI_COMMANDS)


@pytest.mark.parametrize("command", dflash_jax_commands())
def test_every_dflash_jax_command_parses_with_its_flags(command):
    parse_flags(command)


def test_a_renamed_flag_fails_the_parse():
    with pytest.raises(flags.Error, match="max_new_token"):
        parse_flags("dflash-jax evaluate --workdir /run --max_new_token 8")


def test_a_command_whose_batch_or_mesh_does_not_fit_its_slice_fails_the_check():
    files = "--config.target_dir=/ckpt/target --config.data.train_files=/data/train.jsonl"
    with pytest.raises(ConfigError, match=r"must be a multiple of the mesh's data x fsdp size \(32\)"):
        check(f"sbatch --nodes=4 launch/slurm.sbatch configs/qwen27b.py /shared/run {files} "
              "--config.data.batch_size=8")
    with pytest.raises(ConfigError, match=r"does not divide 6 devices"):
        check(f"launch/tpu_pod.sh run pod --zone z --type v6e-6 configs/qwen27b.py gs://b/run {files} "
              "--config.mesh.tensor=4")
    check(f"launch/tpu_pod.sh run pod --zone z --type v5p-64 --spot configs/qwen27b.py gs://b/run {files} "
          "--config.mesh.tensor=4")  # 32 chips: fsdp 8 x tensor 4, 8 rows
