"""A frozen target as an Orbax (tensorstore) checkpoint: written from a Hugging Face directory, restored onto
any mesh shard by shard.

Directory layout written by `write_orbax_target` (`dflash-jax convert`):
    config.json (+ the tokenizer and other small files)   copied from the HF directory
    params/                                                Orbax checkpoint: one array per NNX variable, named
                                                           by its path ("layers.mlp.up_proj.kernel"), in the
                                                           model's own layout (kernels [in, out], stacked layers)
    dflash_target.json                                     marker, written last: the conversion completed
    dflash_output.json                                     written first: what --overwrite may replace

Writing streams one NNX variable at a time (Orbax partial saves), filled tensor by tensor from the
memory-mapped safetensors; restoring reads each device's shard straight from tensorstore.
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
from jax.sharding import Mesh, SingleDeviceSharding
from orbax.checkpoint import v1 as ocp
from tqdm import tqdm

from dflash_jax.runtime import storage
from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.runtime.paths import as_path, is_url
from dflash_jax.sharding import state_shardings
from dflash_jax.weights.families import resolve
from dflash_jax.weights.mapping import WeightRule
from dflash_jax.weights.hub import local_dir
from dflash_jax.weights.output_dir import prepare_output_dir
from dflash_jax.weights.safetensors_dir import INDEX_FILE, CheckpointReader, read_config, read_json

MARKER_FILE = "dflash_target.json"
OUTPUT_KIND = "Orbax target"  # in the output directory's ownership file (weights/output_dir.py)
PARAMS_DIR = "params"
# Version 2: a Gated DeltaNet's fused q|k|v projection and conv are stored as their q, k and v parts.
FORMAT, VERSION = "dflash_jax.orbax_target", 2


def leaf_name(path: tuple) -> str:
    """NNX variable path -> checkpoint array name, e.g. ('layers', 'mlp', 'up_proj', 'kernel')."""
    return ".".join(map(str, path))


def is_orbax_target(directory: str | Path) -> bool:
    return (Path(directory) / MARKER_FILE).is_file()


def write_orbax_target(hf_dir: str | Path, out_dir: str | Path, *, dtype=jnp.bfloat16, overwrite: bool = False,
                       progress: bool = True) -> Path:
    """Convert the HF checkpoint `hf_dir` into an Orbax target directory `out_dir`; returns `out_dir`.

    Weights are stored in `dtype` (variables the model keeps in fp32, e.g. Qwen3.5's A_log, stay fp32).
    Peak host memory is one NNX variable (for stacked layer weights: all layers of one weight, e.g. every
    layer's up_proj) plus one HF tensor: the variable's buffer is filled layer by layer from memory-mapped
    safetensors and saved before the next one is started. `out_dir` must be absent or empty, or with
    `overwrite` an earlier Orbax target (weights/output_dir.py says what may be replaced).
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
    for rule in rules:
        variable = variables[rule.path]
        value = np.empty(variable.shape, np.dtype(variable.dtype))
        stacked = (rule.layers is not None) + (rule.experts is not None)  # leading [layers] and/or [experts] axes
        for layer, group in enumerate(rule.layer_names()):
            for expert, name in enumerate(group):
                index = ((layer,) if rule.layers is not None else ()) + ((expert,) if rule.experts is not None else ())
                try:
                    piece = rule.fixup(reader.read(name))
                except ValueError as error:  # a fix-up that checks its input's shape itself
                    raise CheckpointError(f"{hf_dir}: tensor {name} {error}") from None
                if piece.shape != value.shape[stacked:]:
                    raise CheckpointError(f"{hf_dir}: tensor {name} has shape {tuple(reader.shape(name))}, which "
                                          f"does not fit {leaf_name(rule.path)} {value.shape} of this config")
                value[index] = piece  # casts to the stored dtype
                bar.update(1)
        ocp.partial.save(out_dir / PARAMS_DIR, {leaf_name(rule.path): value})
        del value
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
    if mesh is not None:
        shardings = {path: s.get_value() for path, s in nnx.to_flat_state(state_shardings(state, mesh, target_layout))}
    else:
        shardings = {path: SingleDeviceSharding(jax.devices()[0]) for path, _ in nnx.to_flat_state(state)}
    variables = dict(nnx.to_flat_state(state))
    targets = {leaf_name(path): jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[path])
               for path, v in variables.items()}

    stored = ocp.metadata(params_dir).metadata
    missing, unexpected = sorted(set(targets) - set(stored)), sorted(set(stored) - set(targets))
    wrong = [f"{name} {tuple(stored[name].shape)} (config.json needs {targets[name].shape})"
             for name in sorted(set(targets) & set(stored)) if tuple(stored[name].shape) != targets[name].shape]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{params_dir}: does not match {directory / 'config.json'}: missing arrays {missing}, "
                              f"unexpected arrays {unexpected}, wrong shapes {wrong}")
    # TensorStore's own retries of an unanswered request take a quarter of an hour: a bucket's read is bounded
    # by the storage watchdog instead (design §7.2).
    size = sum(np.dtype(t.dtype).itemsize * int(np.prod(t.shape)) for t in targets.values())
    with storage.deadline("target restore", str(params_dir), size) if is_url(params_dir) else contextlib.nullcontext():
        restored = ocp.load(params_dir, targets)
    for path, variable in variables.items():
        variable.set_value(restored[leaf_name(path)])
    return nnx.merge(graphdef, state), config
