"""Every file a drafter is written to or read from: the z-lab export directory and a training workdir.

The z-lab directory (design §10): config.json + model.safetensors, the layout vLLM loads with
`method: "dflash"`: a flat Qwen3 config plus the DFlash keys, and the drafter's own
tensors (bf16, PyTorch [out, in], unprefixed; no embed_tokens/lm_head, so vLLM shares the target's). A DSpark
drafter is written in the speculators layout vLLM serves with `method: "dspark"` (weights/speculators_dspark.py,
design §18.1): the same backbone tensors plus its two heads, and a speculators config.json. A DFlash2 drafter
keeps the z-lab layout with its own architecture and keys (weights/dflash2_layout.py, design §18.5).
`export_drafter` writes a `Drafter`; `load_drafter_dir` reads such a directory (ours or a published z-lab
one) back into NNX. A training workdir holds drafter_config.json and Orbax checkpoints of the train state,
which train/checkpoint.py writes and reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.models.layers import rope_type_of
from dflash_jax.weights import dflash2_layout
from dflash_jax.weights.hub import local_dir
from dflash_jax.weights.output_dir import FILE_MODE, check_output_dir, prepare_output_dir, write_text
from dflash_jax.weights.safetensors_dir import SINGLE_FILE, CheckpointReader, read_config
from dflash_jax.weights.speculators_dspark import HEAD_TENSORS, dspark_config, is_dspark, zlab_view

CONFIG_FILE = "config.json"
# A training workdir (`dflash-jax train --workdir`): the drafter's architecture and the train state checkpoints.
DRAFTER_CONFIG_FILE, CHECKPOINTS_DIR = "drafter_config.json", "checkpoints"
OUTPUT_KIND = "drafter export"  # in the output directory's ownership file (weights/output_dir.py)
CARD_FILE = "README.md"  # the model card written beside the weights (weights/model_card.py)
SLIDING = "sliding_attention"


def zlab_config(config: DrafterConfig) -> dict:
    """config.json of an exported drafter (design §10): a Qwen3 config of the drafter plus the DFlash keys.

    Every attention-relevant value is written explicitly so vLLM's per-layer resolution (design §10.2:
    sliding layers causal with window W, full layers bidirectional) reproduces the trained mask. No
    `eagle_aux_hidden_state_layer_ids`: vLLM would prefer it over dflash_config.target_layer_ids.
    """
    rope_scaling = dict(config.rope_scaling) if config.rope_scaling else None
    sliding = SLIDING in config.layer_types
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        # transformers v5 / vLLM read RoPE from rope_parameters; it carries the same theta and scaling.
        "rope_parameters": {**(rope_scaling or {}), "rope_type": rope_type_of(rope_scaling),
                            "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "initializer_range": 0.02,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                          "block_size": config.block_size},
        "dtype": "bfloat16",
    }


def export_config(config: DrafterConfig, target: str | None = None) -> dict:
    """config.json of the export: the z-lab one (DFlash2's with its own keys), or for DSpark the speculators
    one naming `target`."""
    layouts = {"z-lab": lambda zlab: zlab,
               "z-lab dflash2": lambda zlab: dflash2_layout.dflash2_config(zlab, config),
               "speculators dspark": lambda zlab: dspark_config(zlab, config.markov_rank, target)}
    return layouts[config.drafter_method.export_layout](zlab_config(config))


def serve_command(target: str, export_dir: str | Path, config: DrafterConfig) -> str:
    """The `vllm serve` line of design §10 for this export. vLLM (0.32) serves DSpark, DFlash2 and a drafter
    that mixes sliding and full attention layers only with its V2 model runner, which an environment variable
    selects; a DSpark block drafts block_size tokens (design §18), a DFlash or DFlash2 one block_size - 1, and
    DFlash2 is served as method "dflash" (its architecture selects the candidate walk, design §18.5)."""
    method = config.drafter_method
    spec = json.dumps({"method": method.serve_method, "model": str(export_dir),
                       "num_speculative_tokens": method.draft_length(config.block_size)}, separators=(",", ":"))
    v2_only = method.needs_v2_runner or len(set(config.layer_types)) > 1
    runner = "VLLM_USE_V2_MODEL_RUNNER=1 " if v2_only else ""
    return f"{runner}vllm serve {target} --speculative-config '{spec}'"


def check_servable_layer_ids(ids, where: str) -> None:
    """vLLM captures the target layers sorted(set(ids)) and concatenates them in that order: repeated ids would
    give fc too few features, unsorted ones would silently feed fc's columns the wrong layers."""
    if list(ids) != sorted(set(ids)):
        raise CheckpointError(f"{where}: target_layer_ids {list(ids)} must be strictly increasing to be served by "
                              f"vLLM")


def check_out_dir(out_dir: str | os.PathLike, overwrite: bool, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Raise OutputDirError unless `out_dir` may receive an export (weights/output_dir.py): absent, empty, or
    with `overwrite` an earlier export and nothing else; never inside or around one of `inputs`."""
    check_output_dir(out_dir, kind=OUTPUT_KIND, inputs=inputs, overwrite=overwrite)


def export_drafter(drafter: Drafter, config: DrafterConfig, out_dir: str | os.PathLike, *, overwrite: bool = False,
                   inputs: Iterable[str | os.PathLike] = (), target: str | None = None) -> Path:
    """Write `drafter` as config.json + model.safetensors (bf16) into `out_dir`; returns the directory.

    Refuses a non-empty `out_dir` unless `overwrite` and it holds an earlier export and nothing else (vLLM
    reads every *.safetensors of the directory, so nothing else may be left there); `inputs` are the paths
    the export was made from, which `out_dir` must lie outside of. Files are readable by others (0644).
    `target` is the verifier a DSpark config names (vLLM requires the key, not the value).
    """
    if drafter.config != config:
        raise ValueError(f"export_drafter: the drafter was built with {drafter.config}, not with {config}")
    check_servable_layer_ids(config.target_layer_ids, "export_drafter")
    partial_name = SINGLE_FILE + ".partial"
    out_dir = prepare_output_dir(out_dir, kind=OUTPUT_KIND, entries=[CONFIG_FILE, SINGLE_FILE, partial_name, CARD_FILE],
                                 inputs=inputs, overwrite=overwrite)

    tensors = {name: np.ascontiguousarray(np.asarray(jax.device_get(value)).astype(ml_dtypes.bfloat16))
               for name, value in drafter_to_torch_layout(drafter).items()}
    # Write under a temporary name and rename, so a crash never leaves a truncated model.safetensors behind.
    partial = out_dir / partial_name
    save_file(tensors, str(partial), metadata={"format": "pt"})  # transformers insists on format=pt
    os.chmod(partial, FILE_MODE)  # safetensors writes 0600
    os.replace(partial, out_dir / SINGLE_FILE)
    write_text(out_dir / CONFIG_FILE, json.dumps(export_config(config, target), indent=2) + "\n")
    return out_dir


def _rope(raw: dict, where: Path) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from top-level keys (z-lab) or transformers v5's rope_parameters."""
    parameters = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", parameters.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{where}: no rope_theta (neither top-level nor in rope_parameters)")
    scaling = raw.get("rope_scaling")
    if scaling is None and parameters:
        scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    if scaling is not None and dict(scaling) in ({}, {"rope_type": "default"}, {"type": "default"}):
        scaling = None
    return theta, scaling


def _layer_types(raw: dict, num_layers: int) -> list[str]:
    """layer_types as written, else as transformers' Qwen3Config derives it (sliding from max_window_layers)."""
    if raw.get("layer_types") is not None:
        return list(raw["layer_types"])
    sliding_from = raw.get("max_window_layers", num_layers) if raw.get("use_sliding_window") else num_layers
    return [SLIDING if i >= sliding_from else "full_attention" for i in range(num_layers)]


def drafter_config_from_zlab(raw: dict, where: Path | str = CONFIG_FILE) -> DrafterConfig:
    """A DrafterConfig from a z-lab style config.json dict; `where` names the file in errors.

    Accepts block_size at top level, in dflash_config, or both (they must agree). Refuses settings the
    drafter cannot reproduce: a causality override that contradicts the per-layer semantics (design §5), and
    an `eagle_aux_hidden_state_layer_ids` that disagrees with dflash_config.target_layer_ids + 1.
    """
    where = Path(where)
    if raw.get("model_type") != "qwen3":
        raise CheckpointError(f"{where}: model_type {raw.get('model_type')!r} is not 'qwen3'")
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict) or "target_layer_ids" not in dflash:
        raise CheckpointError(f"{where}: dflash_config.target_layer_ids is missing")
    missing = [key for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "head_dim", "rms_norm_eps", "num_target_layers", "vocab_size",
                               "max_position_embeddings") if raw.get(key) is None]
    if missing:
        raise CheckpointError(f"{where}: missing field(s) {', '.join(missing)}")
    sizes = {raw.get("block_size"), dflash.get("block_size")} - {None}
    if len(sizes) != 1:
        raise CheckpointError(f"{where}: block_size must be given at top level or in dflash_config (equal if "
                              f"both); got {raw.get('block_size')!r} and dflash_config.block_size "
                              f"{dflash.get('block_size')!r}")
    mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
    if mask_token_id is None:
        raise CheckpointError(f"{where}: no mask_token_id (neither in dflash_config nor top-level)")
    if raw.get("hidden_act", "silu") != "silu" or raw.get("attention_bias", False):
        raise CheckpointError(f"{where}: hidden_act {raw.get('hidden_act')!r} / attention_bias "
                              f"{raw.get('attention_bias')!r}: the drafter is SwiGLU (silu) without biases")

    layer_types = _layer_types(raw, raw["num_hidden_layers"])
    for key, value in (("is_causal", raw.get("is_causal")), ("dflash_config.causal", dflash.get("causal"))):
        if value is not None and any((kind == SLIDING) != bool(value) for kind in layer_types):
            raise CheckpointError(f"{where}: {key}={value} forces every layer {'causal' if value else 'non-causal'}, "
                                  f"but layer_types {layer_types} trains sliding layers causal and full layers "
                                  f"bidirectional (design §5)")
    check_servable_layer_ids(dflash["target_layer_ids"], f"{where}: dflash_config")
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and list(aux) != [i + 1 for i in dflash["target_layer_ids"]]:
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} (which vLLM prefers) is not "
                              f"dflash_config.target_layer_ids + 1 = {[i + 1 for i in dflash['target_layer_ids']]}")
    theta, scaling = _rope(raw, where)
    try:
        return DrafterConfig(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw["head_dim"], rms_norm_eps=raw["rms_norm_eps"], rope_theta=theta, rope_scaling=scaling,
            layer_types=layer_types, sliding_window=raw.get("sliding_window") if SLIDING in layer_types else None,
            block_size=sizes.pop(), target_layer_ids=dflash["target_layer_ids"],
            num_target_layers=raw["num_target_layers"], mask_token_id=mask_token_id, vocab_size=raw["vocab_size"],
            max_position_embeddings=raw["max_position_embeddings"])
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{where}: {error}") from None


def drafter_config_from_file(raw: dict, where: Path | str = CONFIG_FILE) -> DrafterConfig:
    """A DrafterConfig from an export's config.json dict: the z-lab layout (DFlash or DFlash2), or the speculators
    DSpark one."""
    if dflash2_layout.is_dflash2(raw):
        fields = dflash2_layout.dflash2_fields(raw, where)
        try:
            return dataclasses.replace(drafter_config_from_zlab(raw, where), method="dflash2", **fields)
        except (ValueError, TypeError) as error:
            raise CheckpointError(f"{where}: {error}") from None
    if not is_dspark(raw):
        return drafter_config_from_zlab(raw, where)
    zlab, markov_rank = zlab_view(raw, Path(where))
    try:
        return dataclasses.replace(drafter_config_from_zlab(zlab, where), method="dspark", markov_rank=markov_rank)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{where}: {error}") from None


def load_drafter_dir(directory: str | Path, *, param_dtype=jnp.float32, **drafter_kwargs) -> tuple[Drafter,
                                                                                                  DrafterConfig]:
    """Read a drafter directory in the z-lab layout into NNX; returns (drafter, config).

    Tensor names are strict (no missing, no extra) and every shape is checked against config.json; failures
    raise CheckpointError naming the directory. drafter_kwargs go to `Drafter` (dtype, attention_impl, ...).
    `directory` may also be a Hugging Face Hub repo id (weights/hub.py).
    """
    directory = Path(local_dir(directory, "drafter"))
    config = drafter_config_from_file(read_config(directory), directory / CONFIG_FILE)
    return read_drafter_weights(directory, config, param_dtype=param_dtype, **drafter_kwargs), config


def read_drafter_weights(directory: str | Path, config: DrafterConfig, *, param_dtype=jnp.float32,
                         absent: Iterable[str] = (), **drafter_kwargs) -> Drafter:
    """The tensors of a z-lab directory's safetensors (or a Hub repo id's) as a `Drafter` of `config` (whatever
    its config.json says); CheckpointError naming the directory when they do not fit. `absent`: tensor names
    the directory may lack (`read_warm_start`), whose parameters are left abstract."""
    reader = CheckpointReader(local_dir(directory, "drafter"))
    tensors = {name: reader.read(name) for name in reader.names()}
    try:
        return drafter_from_torch_layout(tensors, config, param_dtype=param_dtype, absent=absent, **drafter_kwargs)
    except ValueError as error:
        raise CheckpointError(f"{directory}: {error}") from None


def read_warm_start(directory: str | Path, config: DrafterConfig, *, param_dtype=jnp.float32) -> Drafter:
    """The weights an export directory gives a run of `config` that starts from it (`drafter.init_from`): every
    tensor for a drafter of the same method; for a drafter of a method with fewer parts (a DFlash one starting a
    DSpark run, design §18) the backbone, the parts it lacks left abstract for the run's own initialisation.
    A directory whose drafter has parts `config` lacks is refused (they would be dropped), as are missing or
    unexpected backbone tensors and shape mismatches (CheckpointError naming the directory)."""
    directory = Path(local_dir(directory, "drafter"))
    source = drafter_config_from_file(read_config(directory), directory / CONFIG_FILE)
    ours, theirs = tensor_names(config), tensor_names(source)
    if theirs - ours:
        raise CheckpointError(f"{directory}: a {source.method!r} drafter cannot start a {config.method!r} run: its "
                              f"{', '.join(sorted(theirs - ours))} would be dropped")
    return read_drafter_weights(directory, config, param_dtype=param_dtype, absent=ours - theirs)


def tensor_names(config: DrafterConfig) -> set[str]:
    """The export names of every tensor a drafter of `config` has."""
    abstract = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))
    return {_torch_name(path)[0] for path, _ in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def _torch_name(path: tuple) -> tuple[str, bool]:
    """NNX parameter path -> (z-lab export name, whether the tensor is a Linear kernel to transpose).

    The module attributes above carry the export names, so ('layers', 0, 'self_attn', 'q_proj', 'kernel')
    becomes 'layers.0.self_attn.q_proj.weight'; DSpark's heads have names of their own (HEAD_TENSORS), and
    DFlash2's base kernels and codebooks are parameters, not modules: no '.weight' (design §18.5).
    """
    if tuple(path) in HEAD_TENSORS:
        return HEAD_TENSORS[tuple(path)]
    *module_path, leaf = path
    if leaf in dflash2_layout.BARE_PARAMETERS:
        return ".".join(map(str, path)), False
    return ".".join(map(str, module_path)) + ".weight", leaf == "kernel"


def drafter_to_torch_layout(drafter: Drafter) -> dict[str, np.ndarray]:
    """Every trained weight under its z-lab export name (design §10), Linear weights in PyTorch [out, in]."""
    tensors = {}
    for path, param in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        name, is_kernel = _torch_name(path)
        value = np.asarray(param.get_value())
        tensors[name] = value.T if is_kernel else value
    return tensors


def drafter_from_torch_layout(tensors: Mapping[str, np.ndarray], config: DrafterConfig, *,
                              param_dtype=jnp.float32, absent: Iterable[str] = (), **drafter_kwargs) -> Drafter:
    """The inverse of `drafter_to_torch_layout`: a Drafter holding exactly these tensors.

    Raises ValueError naming missing or unexpected tensors and shape mismatches. drafter_kwargs go to Drafter.
    Tensors named in `absent` may be missing: their parameters keep abstract values (jax.ShapeDtypeStruct).
    """
    abstract = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0), param_dtype=param_dtype,
                                              **drafter_kwargs))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    variables = {_torch_name(path): variable for path, variable in nnx.to_flat_state(params)}
    expected = {name for name, _ in variables}
    missing, unexpected = sorted(expected - set(tensors) - set(absent)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"drafter tensors do not match the DrafterConfig: missing {missing}, unexpected {unexpected}")
    for (name, is_kernel), variable in variables.items():
        if name not in tensors:  # one of `absent`
            continue
        value = np.asarray(tensors[name])
        value = value.T if is_kernel else value
        if value.shape != tuple(variable.shape):
            torch_shape = tuple(reversed(variable.shape)) if is_kernel else tuple(variable.shape)
            raise ValueError(f"tensor {name} has shape {np.asarray(tensors[name]).shape}, expected {torch_shape}")
        variable.set_value(jnp.asarray(value, dtype=variable.dtype))
    return nnx.merge(graphdef, params, rest)
