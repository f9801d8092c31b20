"""A frozen target as an Orbax (tensorstore) checkpoint: written from a Hugging Face directory, restored onto
any mesh shard by shard.

Directory layout written by `write_orbax_target` (`dflash-jax convert`):
    config.json (+ the tokenizer and other small files)   copied from the HF directory
    params/                                                Orbax checkpoint: the NNX variables in the model's own
                                                           layout (kernels [in, out]), named by their path
                                                           ("embed_tokens.embedding"); a variable stacked over
                                                           layers as one array per layer of its stack
                                                           ("layers.mlp.up_proj.kernel#3": the 4th layer's)
    dflash_target.json                                     marker, written last: the conversion completed
    dflash_output.json                                     written first: what --overwrite may replace

Writing streams one HF layer at a time (an Orbax partial save per layer, from the memory-mapped safetensors), so
host memory holds one layer's tensors (a layer's experts, for a mixture-of-experts target); restoring reads each
device's shard of a layer straight from tensorstore into its stack, layer by layer.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from orbax.checkpoint import v1 as ocp
from tqdm import tqdm

from dflash_jax.runtime import storage
from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.runtime.paths import as_path, is_url
from dflash_jax.sharding import state_shardings
from dflash_jax.weights.families import resolve
from dflash_jax.weights.mapping import LayerStacks, WeightRule, layer_groups, read_group
from dflash_jax.weights.hub import local_dir
from dflash_jax.weights.output_dir import prepare_output_dir
from dflash_jax.weights.safetensors_dir import INDEX_FILE, CheckpointReader, read_config, read_json

MARKER_FILE = "dflash_target.json"
OUTPUT_KIND = "Orbax target"  # in the output directory's ownership file (weights/output_dir.py)
PARAMS_DIR = "params"
# Version 2: a Gated DeltaNet's fused q|k|v projection and conv are stored as their q, k and v parts. Version 3:
# stacked variables are stored one array per layer.
FORMAT, VERSION = "dflash_jax.orbax_target", 3
LAYER_MARK = "#"  # "<variable>#<position in its stack>"


def leaf_name(path: tuple) -> str:
    """NNX variable path -> checkpoint array name, e.g. ('layers', 'mlp', 'up_proj', 'kernel')."""
    return ".".join(map(str, path))


def stored_name(path: tuple, position: int | None) -> str:
    """The array name of a variable, or of layer `position` of a stacked one."""
    return leaf_name(path) if position is None else f"{leaf_name(path)}{LAYER_MARK}{position}"


def is_orbax_target(directory: str | Path) -> bool:
    return (Path(directory) / MARKER_FILE).is_file()


def write_orbax_target(hf_dir: str | Path, out_dir: str | Path, *, dtype=jnp.bfloat16, overwrite: bool = False,
                       progress: bool = True) -> Path:
    """Convert the HF checkpoint `hf_dir` into an Orbax target directory `out_dir`; returns `out_dir`.

    Weights are stored in `dtype` (variables the model keeps in fp32, e.g. Qwen3.5's A_log, stay fp32).
    Peak host memory is one HF layer's tensors (a layer's experts, for a mixture-of-experts target): the layers
    are read one at a time from memory-mapped safetensors and saved (an Orbax partial save) before the next is
    read. `out_dir` must be absent or empty, or with `overwrite` an earlier Orbax target
    (weights/output_dir.py says what may be replaced).
    """
    hf_dir, out_dir = Path(local_dir(hf_dir, "target")), Path(out_dir)  # hf_dir may be a Hub repo id
    hf_config = read_config(hf_dir)
    family, config = resolve(hf_config, hf_dir / "config.json")
    reader = CheckpointReader(hf_dir)
    # config, tokenizer, generation config: every file but the weights is copied alongside.
    copied = [item for item in sorted(hf_dir.iterdir())
              if item.is_file() and not item.name.endswith(".safetensors") and item.name != INDEX_FILE]
    entries = [PARAMS_DIR, PARAMS_DIR + ".partial_save", MARKER_FILE, *(item.name for item in copied)]
    rules = family.checkpoint_rules(config, reader.names())
    _check_tensor_names(reader, rules, family.ignored(config))
    abstract = family.abstract_model(config, param_dtype=dtype)
    variables = dict(nnx.to_flat_state(nnx.state(abstract)))
    uncovered = sorted(leaf_name(path) for path in set(variables) - {rule.path for rule in rules})
    if uncovered:
        raise KeyError(f"the {hf_config['model_type']} weight table leaves model variables unset: {uncovered}")
    prepare_output_dir(out_dir, kind=OUTPUT_KIND, entries=entries, inputs=[hf_dir], overwrite=overwrite)

    bar = tqdm(total=sum(len(rule.names()) for rule in rules), unit="tensor", desc=f"{hf_dir.name} -> Orbax",
               disable=not progress)
    for group in layer_groups(rules):
        arrays = {}
        for rule, position, value in read_group(reader, group, variables):
            arrays[stored_name(rule.path, position)] = value
            bar.update(len(rule.layer_names()[position or 0]))
        ocp.partial.save(out_dir / PARAMS_DIR, arrays)
        del arrays
    bar.close()
    ocp.partial.finalize(out_dir / PARAMS_DIR)

    for item in copied:
        shutil.copy2(item, out_dir / item.name)
    marker = {"format": FORMAT, "version": VERSION, "model_type": hf_config["model_type"],
              "dtype": jnp.dtype(dtype).name, "source": str(hf_dir)}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def _check_tensor_names(reader: CheckpointReader, rules: list[WeightRule], skipped: tuple[str, ...]) -> None:
    wanted = {name for rule in rules for name in rule.names()}
    missing = sorted(wanted - set(reader.names()))
    unexpected = sorted(name for name in reader.names() if name not in wanted and not name.startswith(skipped))
    if missing or unexpected:
        raise CheckpointError(f"{reader.dir}: missing tensors {missing}, unexpected tensors {unexpected}")


def load_orbax_target(directory: str | Path, *, param_dtype=jnp.bfloat16, mesh: Mesh | None = None,
                      attention_impl: str = "xla", target_layout: str = "fsdp", delta_rule_dtype: str = "float32"):
    """Restore a directory written by `write_orbax_target`; returns (model, config) like `load_target`.

    With a mesh each variable is restored directly onto its sharding from the logical-axis rules (each
    device reads only its shard; `target_layout` as in `load_target`); without one, onto the first device.
    Stored weights are cast to the model's dtypes (`param_dtype`, fp32 where the model insists). A directory
    in a bucket has its small files read from a local copy and its arrays read in place (dflash_jax/runtime/paths.py).
    """
    params_dir = (as_path(directory) if is_url(directory) else Path(directory)) / PARAMS_DIR
    directory = Path(local_dir(directory, "target"))
    marker = read_json(directory / MARKER_FILE)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise CheckpointError(f"{directory / MARKER_FILE}: format {marker.get('format')!r} version "
                              f"{marker.get('version')!r}, expected {FORMAT!r} version {VERSION}; write it again from the "
                              "Hugging Face checkpoint with `dflash-jax convert`")
    family, config = resolve(read_config(directory), directory / "config.json")
    abstract = family.abstract_model(config, param_dtype=param_dtype, attention_impl=attention_impl, mesh=mesh,
                                     delta_rule_dtype=delta_rule_dtype)
    graphdef, state = nnx.split(abstract)
    shardings = ({path: s.get_value() for path, s in nnx.to_flat_state(state_shardings(state, mesh, target_layout))}
                 if mesh is not None else {})
    variables = dict(nnx.to_flat_state(state))
    stored = ocp.metadata(params_dir).metadata
    layers = _stored_layers(stored)
    shapes = {**{name: tuple(array.shape) for name, array in stored.items() if LAYER_MARK not in name},
              **{name: (len(shapes), *shapes[0]) for name, shapes in layers.items()}}
    targets = {leaf_name(path): tuple(v.shape) for path, v in variables.items()}
    missing, unexpected = sorted(set(targets) - set(shapes)), sorted(set(shapes) - set(targets))
    wrong = [f"{name} {shapes[name]} (config.json needs {targets[name]})"
             for name in sorted(set(targets) & set(shapes)) if shapes[name] != targets[name]]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{params_dir}: does not match {directory / 'config.json'}: missing arrays {missing}, "
                              f"unexpected arrays {unexpected}, wrong shapes {wrong}")

    # The whole variables in one read, then each position of the stacks in one read: a device's shard of one
    # layer at a time travels, into its place in the stack (weights/mapping.py).
    stacks = LayerStacks(variables, shardings)
    by_position = [[(path, None) for path in variables if leaf_name(path) not in layers]]
    for position in range(max(map(len, layers.values()), default=0)):
        by_position.append([(path, position) for path in variables if len(layers.get(leaf_name(path), ())) > position])
    # TensorStore's own retries of an unanswered request take a quarter of an hour: a bucket's read is bounded
    # by the storage watchdog instead (design §7.2).
    size = sum(np.dtype(v.dtype).itemsize * int(np.prod(v.shape)) for v in variables.values())
    with storage.deadline("target restore", str(params_dir), size) if is_url(params_dir) else contextlib.nullcontext():
        for group in by_position:
            wanted = {stored_name(path, position): _abstract(variables[path], shardings.get(path), position)
                      for path, position in group}
            restored = ocp.load(params_dir, {name: wanted.get(name, ocp.PLACEHOLDER) for name in stored})
            for path, position in group:
                stacks.put(path, position, restored[stored_name(path, position)])
    for path, variable in variables.items():
        variable.set_value(stacks.values[path])
    return nnx.merge(graphdef, state), config


def _stored_layers(stored) -> dict[str, list[tuple[int, ...]]]:
    """Per stacked variable's name, the shape of each stored layer, in stack order."""
    layers: dict[str, dict[int, tuple[int, ...]]] = {}
    for name, metadata in stored.items():
        if LAYER_MARK in name:
            base, position = name.rsplit(LAYER_MARK, 1)
            layers.setdefault(base, {})[int(position)] = tuple(metadata.shape)
    return {name: [shapes[i] for i in sorted(shapes)] for name, shapes in layers.items()}


def _abstract(variable, sharding, position: int | None) -> jax.ShapeDtypeStruct:
    """What to restore a variable (or one layer of its stack) as: its dtype, on its sharding (the first device
    without a mesh)."""
    shape = variable.shape if position is None else variable.shape[1:]
    if sharding is None:
        sharding = SingleDeviceSharding(jax.devices()[0])
    elif position is not None:
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(shape, variable.dtype, sharding=sharding)
