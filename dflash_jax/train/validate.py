"""Start-up checks of the training config, and the drafter config resolved from it and the target.

Every problem is a `ConfigError` whose single-line message names the offending config field, raised before
anything is compiled, so a bad run fails in seconds with a sentence instead of minutes later with a JAX
traceback. `validate_config` needs only the config; `resolve_drafter_config` also needs the loaded target's
config and the tokenizer (design §2, §3, §10 for the defaults).
"""

from __future__ import annotations

import ast
import difflib
import json
import logging
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

from dflash_jax.data.corpus import check_input_files
from dflash_jax.data.sources import resolve_sources
from dflash_jax.methods import METHODS, method_for
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.models.dflash import LABEL_SOURCES
from dflash_jax.models.drafter import LAYER_TYPES, REMAT_POLICIES, DrafterConfig, default_target_layer_ids
from dflash_jax.ops.anchors import check_block_size
from dflash_jax.ops.backends import ATTENTION_CHOICES
from dflash_jax.ops.gated_delta import MATMUL_CHOICES
from dflash_jax.sharding import TARGET_LAYOUTS, make_mesh
from dflash_jax.train.config import REMOVED, RENAMED, base_config, field_paths
from dflash_jax.train.divergences import TERMS as LOSS_TERMS

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "muon")
POSITION_WEIGHTS = ("decay", "dpace")
BAD_RECORDS = ("raise", "skip")
DTYPES = ("float32", "bfloat16", "float16")
EVAL_CONTINUATIONS = ("generate", "data")  # config.eval_continuation
DRAFTER_METHODS = tuple(METHODS)  # config.drafter.method (design §18)
# config.drafter's DFlash2 fields (design §18.4), each a positive int; DrafterConfig checks how they fit the drafter.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _field(config: ConfigDict, path: str):
    for key in path.split("."):
        config = config[key]
    return config


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def parse_chat_template_kwargs(value: Any, what: str) -> dict[str, Any] | None:
    """Arguments of the chat template as a dict: a dict, or text holding a JSON object or a Python dict literal
    (a command line gives text); None stays None. ConfigError naming `what` (the flag or field) otherwise."""
    return parse_mapping(value, what, '{"enable_thinking": false}')


def parse_mapping(value: Any, what: str, example: str) -> dict[str, Any] | None:
    """A dict from a dict or from text holding a JSON object or a Python dict literal; None stays None.
    ConfigError naming `what` with `example` otherwise."""
    if value is None:
        return None
    # A dict set on a ConfigDict field is stored as a ConfigDict (and so is a copy of the config).
    parsed = value.to_dict() if isinstance(value, ConfigDict) else value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                pass
    _require(isinstance(parsed, dict) and all(isinstance(key, str) for key in parsed),
             f"{what} must be a JSON object such as '{example}', got {value!r}")
    return dict(parsed)


def resolve_chat_template_kwargs(config: ConfigDict) -> None:
    """config.data.chat_template_kwargs as a dict, in place (ml_collections cannot take a dict on the command
    line, so there it is text)."""
    config.data.chat_template_kwargs = parse_chat_template_kwargs(config.data.chat_template_kwargs,
                                                                  "config.data.chat_template_kwargs")


def parse_loss_terms(value: Any) -> tuple[tuple[str, float], ...]:
    """config.loss.terms as sorted (name, weight) pairs: a dict, JSON object text or one term's name; None =
    the hard cross-entropy alone. ConfigError naming the field otherwise (design §18)."""
    if value is None:
        return (("ce", 1.0),)
    example = '{"ce": 0.1, "tv": 0.9}'
    parsed = {value: 1.0} if value in LOSS_TERMS else parse_mapping(value, "config.loss.terms", example)
    _require(len(parsed) > 0, f"config.loss.terms is empty; give terms and weights such as '{example}'")
    unknown = sorted(set(parsed) - set(LOSS_TERMS))
    _require(not unknown, f"config.loss.terms has unknown terms {unknown}; allowed: {LOSS_TERMS}")
    for name, weight in parsed.items():
        _require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0,
                 f"config.loss.terms[{name!r}] must be a number > 0, got {weight!r}")
    return tuple(sorted((name, float(weight)) for name, weight in parsed.items()))


def run_config(config: ConfigDict) -> ConfigDict:
    """The run's own copy of the user's config (the caller's is left as given), with the fields a command line
    gives as text in their parsed forms: data.chat_template_kwargs a dict, loss.terms {name: weight}. ConfigError
    for text that does not parse."""
    kwargs = parse_chat_template_kwargs(config.data.chat_template_kwargs, "config.data.chat_template_kwargs")
    terms = dict(parse_loss_terms(config.loss.terms))
    values = config.to_dict()
    # Placeholders of any type, as base_config declares them, so that they hold plain dicts (not ConfigDicts).
    values["data"]["chat_template_kwargs"] = placeholder(object)
    values["loss"]["terms"] = placeholder(object)
    run = ConfigDict(values)
    run.data.chat_template_kwargs, run.loss.terms = kwargs, terms
    return run


def validate_config(config: ConfigDict) -> None:
    """Checks that need nothing but the config (the run's own: `run_config`). Raises ConfigError."""
    check_fields(config)
    data, loss, optim = config.data, config.loss, config.optim
    block_size = config.drafter.block_size
    _require(bool(config.target_dir), "config.target_dir is required: a Hugging Face target checkpoint directory")
    _require(bool(data.train_files), "config.data.train_files is required: one or more data files, globs, "
                                     "directories or dataset ids (--config.data.train_files=a.jsonl or a tuple "
                                     "in the config file)")
    try:
        check_block_size(block_size, "config.drafter.block_size")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _require(data.bad_records in BAD_RECORDS,
             f"config.data.bad_records must be one of {BAD_RECORDS}, got {data.bad_records!r}")
    _require(data.anchor_stride >= 1, f"config.data.anchor_stride must be >= 1, got {data.anchor_stride}")
    _require(data.seq_len % data.anchor_stride == 0,
             f"config.data.seq_len ({data.seq_len}) must be a multiple of config.data.anchor_stride "
             f"({data.anchor_stride}) so the anchor grid is static (design §4)")
    _require(data.max_anchors is None or (isinstance(data.max_anchors, int) and data.max_anchors >= 1),
             f"config.data.max_anchors must be an int >= 1 (anchors a row keeps, design §4) or None, got "
             f"{data.max_anchors!r}")
    _require(data.seq_len >= block_size,
             f"config.data.seq_len ({data.seq_len}) must be >= config.drafter.block_size ({block_size})")
    _require(loss.gamma > 0, f"config.loss.gamma must be > 0 (w_k = exp(-(k-1)/gamma), design §6), got {loss.gamma}")
    _require(loss.position_weights in POSITION_WEIGHTS,
             f"config.loss.position_weights must be one of {POSITION_WEIGHTS}, got {loss.position_weights!r}")
    _require(0 <= loss.dpace_alpha <= 1,
             f"config.loss.dpace_alpha must lie in [0, 1] (D-PACE smoothing, design §6), got {loss.dpace_alpha}")
    _require(loss.labels in LABEL_SOURCES, f"config.loss.labels must be one of {LABEL_SOURCES}, got {loss.labels!r}")
    terms = parse_loss_terms(loss.terms)
    _require(loss.position_weights != "dpace" or set(dict(terms)) == {"ce"},
             f"config.loss.position_weights='dpace' is defined for the 'ce' term alone, but config.loss.terms is "
             f"{dict(terms)}; set config.loss.position_weights=decay")
    _require(config.attention_impl in ATTENTION_CHOICES,
             f"config.attention_impl must be one of {ATTENTION_CHOICES}, got {config.attention_impl!r}")
    validate_target_layout(config)
    _require(config.remat in REMAT_POLICIES, f"config.remat must be one of {list(REMAT_POLICIES)}, got {config.remat!r}")
    _require(config.target_matmul_dtype in MATMUL_CHOICES,
             f"config.target_matmul_dtype must be one of {MATMUL_CHOICES}, got {config.target_matmul_dtype!r}")
    for field in ("target_dtype", "compute_dtype"):
        _require(config[field] in DTYPES, f"config.{field} must be one of {DTYPES}, got {config[field]!r}")
    _require(loss.noise_std >= 0, f"config.loss.noise_std must be >= 0, got {loss.noise_std}")
    _require(optim.name in OPTIMIZERS, f"config.optim.name must be one of {OPTIMIZERS}, got {optim.name!r}")
    _require(config.total_steps is not None or config.epochs is not None,
             "give config.total_steps or config.epochs (the schedule's length; epochs derives the steps from the "
             "corpus)")
    if config.total_steps is not None and config.epochs is not None:  # e.g. a short run of a recipe in epochs
        log.warning("config.total_steps = %d takes precedence over config.epochs = %g", config.total_steps,
                    config.epochs)
    _require(config.total_steps is None or config.total_steps >= 1,
             f"config.total_steps must be >= 1, got {config.total_steps}")
    _require(config.epochs is None or config.epochs > 0, f"config.epochs must be > 0, got {config.epochs}")
    if data.batch_size is not None and data.rows_per_device is not None:
        log.warning("config.data.batch_size = %d takes precedence over config.data.rows_per_device = %d",
                    data.batch_size, data.rows_per_device)
    rows = data.batch_size if data.batch_size is not None else rows_per_device(config)
    _require(rows >= 1, f"config.data.{'batch_size' if data.batch_size is not None else 'rows_per_device'} must be "
                        f">= 1, got {rows}")
    for path in ("grad_accum_steps", "loss.vocab_chunk", "loss.row_chunk",
                 "query_chunk_blocks", "log_every", "checkpoint_every", "keep_checkpoints"):
        value = _field(config, path)
        _require(value >= 1, f"config.{path} must be >= 1, got {value}")
    storage = config.storage
    _require(storage.deadline_seconds is None or storage.deadline_seconds > 0,
             f"config.storage.deadline_seconds must be > 0, got {storage.deadline_seconds}")
    _require(storage.retries is None or storage.retries >= 0,
             f"config.storage.retries must be >= 0, got {storage.retries}")
    _require(config.stop_grace_seconds > 0, f"config.stop_grace_seconds must be > 0, got {config.stop_grace_seconds}")
    _require(config.eval_every >= 0, f"config.eval_every must be >= 0 (0 = never), got {config.eval_every}")
    _require(config.eval_continuation in EVAL_CONTINUATIONS,
             f"config.eval_continuation must be one of {EVAL_CONTINUATIONS}, got {config.eval_continuation!r}")
    _require(config.eval_max_new_tokens >= 1,
             f"config.eval_max_new_tokens must be >= 1, got {config.eval_max_new_tokens}")
    profile = config.profile_steps
    _require(profile is None or (len(profile) == 2 and 1 <= profile[0] <= profile[1]),
             f"config.profile_steps must be (first, last) with 1 <= first <= last, got {profile!r}")
    _require(data.batch_size is None or data.batch_size % config.grad_accum_steps == 0,
             f"config.data.batch_size ({data.batch_size}) must be a multiple of config.grad_accum_steps "
             f"({config.grad_accum_steps})")
    _require(0 <= optim.warmup_ratio < 1, f"config.optim.warmup_ratio must lie in [0, 1), got {optim.warmup_ratio}")
    _require(optim.learning_rate > 0, f"config.optim.learning_rate must be > 0, got {optim.learning_rate}")
    if optim.name == "muon":
        _require(optim.muon_learning_rate is None or optim.muon_learning_rate > 0,
                 f"config.optim.muon_learning_rate must be > 0 (or None: optim.learning_rate), "
                 f"got {optim.muon_learning_rate}")
        _require(0 <= optim.muon_momentum < 1,
                 f"config.optim.muon_momentum must lie in [0, 1), got {optim.muon_momentum}")
        _require(optim.muon_ns_steps >= 1, f"config.optim.muon_ns_steps must be >= 1, got {optim.muon_ns_steps}")
        _require(optim.muon_ns_dtype in ("float32", "bfloat16"),
                 f"config.optim.muon_ns_dtype must be 'float32' or 'bfloat16', got {optim.muon_ns_dtype!r}")
        _require(optim.muon_weight_decay >= 0,
                 f"config.optim.muon_weight_decay must be >= 0, got {optim.muon_weight_decay}")

    drafter = config.drafter
    layer_types = tuple(drafter.layer_types)
    _require(len(layer_types) == drafter.num_hidden_layers,
             f"config.drafter.layer_types has {len(layer_types)} entries but config.drafter.num_hidden_layers is "
             f"{drafter.num_hidden_layers}; give one type per drafter layer")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    _require(not unknown, f"config.drafter.layer_types has unknown types {unknown}; allowed: {LAYER_TYPES}")
    if "sliding_attention" in layer_types:
        window = drafter.sliding_window
        _require(isinstance(window, int) and window >= 1,
                 f"config.drafter.layer_types has a sliding_attention layer but config.drafter.sliding_window is "
                 f"{window!r}; set a positive window (e.g. 2048)")
    _require(drafter.num_feature_layers is None or drafter.num_feature_layers >= 1,
             f"config.drafter.num_feature_layers must be >= 1, got {drafter.num_feature_layers}")
    validate_method(drafter)


def validate_method(drafter: ConfigDict) -> None:
    """config.drafter.method and its own fields (design §18)."""
    _require(drafter.method in DRAFTER_METHODS,
             f"config.drafter.method must be one of {DRAFTER_METHODS}, got {drafter.method!r}")
    _require(drafter.markov_rank >= 1, f"config.drafter.markov_rank must be >= 1, got {drafter.markov_rank}")
    _require(drafter.confidence_alpha >= 0,
             f"config.drafter.confidence_alpha must be >= 0, got {drafter.confidence_alpha}")
    for field in DFLASH2_FIELDS:
        value = drafter[field]
        _require(isinstance(value, int) and value >= 1, f"config.drafter.{field} must be an int >= 1, got {value!r}")
    _require(drafter.selector_alpha >= 0, f"config.drafter.selector_alpha must be >= 0, got {drafter.selector_alpha}")


def unknown_field_message(path: str, known: Iterable[str]) -> str:
    """One line for a config field that does not exist: its new name if it moved, else the nearest valid one."""
    if path in REMOVED:
        return f"config.{path} was removed: {REMOVED[path]}"
    if path in RENAMED:
        return f"config.{path} is now config.{RENAMED[path]} (fields are grouped: drafter, data, loss, optim, mesh)"
    nearest = difflib.get_close_matches(path, list(known), n=1, cutoff=0.5)
    hint = f"; did you mean config.{nearest[0]}?" if nearest else ""
    return f"config.{path} is not a config field{hint} (fields are listed in dflash_jax/train/config.py)"


def check_overrides(argv: Iterable[str], flag: str = "config") -> None:
    """Refuse `--config.<path>=...` flags naming no field of base_config(), before absl parses them (it would
    raise a traceback). Config files only set values (`check_fields`), so base_config() knows every field."""
    known = set(field_paths(base_config()))
    for arg in argv:
        if not arg.startswith(f"--{flag}."):
            continue
        path = arg[len(flag) + 3:].split("=", 1)[0]
        if path not in known and not any(path.startswith(field + ".") for field in known):
            raise ConfigError(unknown_field_message(path, known))


def check_fields(config: ConfigDict) -> None:
    """Refuse a config (e.g. a config file written for an older version) that sets fields base_config() does not
    have; raises ConfigError naming the first such field and its new name."""
    known = set(field_paths(base_config()))
    for path in field_paths(config):
        if path not in known and not any(path.startswith(field + ".") for field in known):
            raise ConfigError(unknown_field_message(path, known))


def validate_target_layout(config: ConfigDict) -> None:
    choices = ["auto", *TARGET_LAYOUTS]
    _require(config.target_layout in choices,
             f"config.target_layout must be one of {choices}, got {config.target_layout!r}")


def validate_data_files(config: ConfigDict) -> None:
    """Every data source exists and is readable: a DataError naming it, before the target loads."""
    resolve_sources(config.data.train_files, "config.data.train_files")
    check_input_files(config.data.eval_files or (), "config.data.eval_files")


def validate_eval_files(config: ConfigDict) -> None:
    """The CLI's evaluation during training (config.eval_every > 0) measures τ on config.data.eval_files."""
    _require(not config.eval_every or bool(config.data.eval_files),
             f"config.eval_every = {config.eval_every} needs config.data.eval_files (JSONL records to measure τ on)")


def rows_per_device(config: ConfigDict) -> int:
    """config.data.rows_per_device, one when unset (the batch when data.batch_size is not given)."""
    return 1 if config.data.rows_per_device is None else config.data.rows_per_device


def batch_size(config: ConfigDict, num_batch_shards: int) -> int:
    """data.batch_size when given; else data.rows_per_device (one when unset) rows for each of the mesh's
    `num_batch_shards` (data x fsdp) devices."""
    if config.data.batch_size is not None:
        return config.data.batch_size
    return rows_per_device(config) * num_batch_shards


def settle_batch_size(config: ConfigDict, num_batch_shards: int) -> None:
    """data.batch_size settled in `config` (the run's, or a plan's copy) as `batch_size` gives it, rows_per_device
    then unset; each micro-batch must split evenly over the mesh's `num_batch_shards` (data x fsdp) devices."""
    config.data.batch_size = batch_size(config, num_batch_shards)
    config.data.rows_per_device = None
    micro_batch = config.data.batch_size // config.grad_accum_steps
    _require(micro_batch % num_batch_shards == 0,
             f"config.data.batch_size / config.grad_accum_steps = {micro_batch} rows per micro-batch must be a "
             f"multiple of the mesh's data x fsdp size ({num_batch_shards}); see config.mesh")


def resolve_mask_token_id(config: ConfigDict, tokenizer, vocab_size: int) -> int:
    """Config value, else the tokenizer's mask token, else len(tokenizer) when it is an unused embedding row
    (design §10). Warns when the chosen id is a token the tokenizer actually produces. `tokenizer` may be None
    (e.g. a benchmark on abstract shapes) only when the config names the mask token."""
    mask_token_id = config.drafter.mask_token_id
    source = "config.drafter.mask_token_id"
    if mask_token_id is None and tokenizer is None:
        raise ConfigError("config.drafter.mask_token_id is not set and there is no tokenizer to take it from")
    if mask_token_id is None and tokenizer.mask_token_id is not None:
        mask_token_id, source = tokenizer.mask_token_id, "the tokenizer's mask token"
    if mask_token_id is None:
        _require(len(tokenizer) < vocab_size,
                 f"config.drafter.mask_token_id is not set, the tokenizer has no mask token, and len(tokenizer) = "
                 f"{len(tokenizer)} is not below the target's vocab_size {vocab_size}, so there is no unused "
                 f"embedding row; set config.drafter.mask_token_id explicitly")
        mask_token_id, source = len(tokenizer), "len(tokenizer), the first unused embedding row"
    _require(0 <= mask_token_id < vocab_size,
             f"config.drafter.mask_token_id = {mask_token_id} ({source}) must lie in [0, target vocab_size = "
             f"{vocab_size})")
    if tokenizer is not None and mask_token_id < len(tokenizer) and mask_token_id not in set(tokenizer.all_special_ids):
        log.warning("config.drafter.mask_token_id = %d (%s) is a regular token the tokenizer produces (%r); the "
                    "drafter cannot tell a masked slot from that token", mask_token_id, source,
                    tokenizer.convert_ids_to_tokens(mask_token_id))
    return int(mask_token_id)


DEFAULT_FEATURE_LAYERS = 5  # target layers fc reads when the config names neither ids nor a count (design §2)


def resolve_drafter_config(config: ConfigDict, target_config, tokenizer) -> DrafterConfig:
    """The drafter's full architecture: config values, with None taken from the target (design §3, §11)."""
    drafter = config.drafter
    hidden = target_config.hidden_size
    num_target_layers = target_config.num_hidden_layers
    count = drafter.num_feature_layers
    if drafter.target_layer_ids is None:
        layer_ids = default_target_layer_ids(num_target_layers, DEFAULT_FEATURE_LAYERS if count is None else count)
    else:
        layer_ids = tuple(int(i) for i in drafter.target_layer_ids)  # DrafterConfig checks their range
        if count is not None and count != len(layer_ids):
            raise ConfigError(f"config.drafter.target_layer_ids has {len(layer_ids)} ids but config.drafter."
                              f"num_feature_layers is {count}: fc would read {len(layer_ids)}*H, not {count}*H = "
                              f"{count * hidden} columns (leave num_feature_layers unset: it is the number of ids)")
    # vLLM captures sorted(set(ids)) and concatenates them in that order (design §10, §12.5): a drafter trained
    # on repeated or unsorted ids could not be served, so refuse it before training rather than at export.
    _require(list(layer_ids) == sorted(set(layer_ids)),
             f"config.drafter.target_layer_ids {list(layer_ids)} must be strictly increasing to be served by vLLM "
             f"(for this {num_target_layers}-layer target, set fewer config.drafter.num_feature_layers or explicit ids)")
    _require(drafter.intermediate_size or target_config.intermediate_size,
             "config.drafter.intermediate_size must be set: this target has experts and no dense MLP width for the "
             "drafter to default to")
    _require(drafter.method in METHODS,  # planning resolves a config validate_config has not seen
             f"config.drafter.method must be one of {DRAFTER_METHODS}, got {drafter.method!r}")
    method = method_for(drafter.method)
    fields = dict(
        hidden_size=hidden,
        intermediate_size=drafter.intermediate_size or target_config.intermediate_size,
        num_hidden_layers=drafter.num_hidden_layers,
        num_attention_heads=drafter.num_attention_heads,
        num_key_value_heads=drafter.num_key_value_heads,
        head_dim=drafter.head_dim,
        rms_norm_eps=drafter.rms_norm_eps,
        rope_theta=float(drafter.rope_theta or target_config.rope_theta),
        rope_scaling=_rope_scaling(drafter.rope_scaling, target_config),
        layer_types=tuple(drafter.layer_types),
        sliding_window=drafter.sliding_window,
        block_size=config.drafter.block_size,
        target_layer_ids=layer_ids,
        num_target_layers=num_target_layers,
        mask_token_id=resolve_mask_token_id(config, tokenizer, target_config.vocab_size),
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        method=drafter.method,
        markov_rank=drafter.markov_rank if method.has_markov_head else 0,
        **{field: drafter[field] if method.has_block_convolution else 0 for field in DFLASH2_FIELDS},
    )
    try:
        return DrafterConfig(**fields)
    except ValueError as error:  # e.g. heads not a multiple of kv heads; the message names the field
        raise ConfigError(f"config.drafter: {error}") from None


def _rope_scaling(configured, target_config) -> dict | None:
    if configured is not None:
        return dict(configured)
    target_scaling = getattr(target_config, "rope_scaling", None)  # Qwen3.5 targets have none (design §10)
    return dict(target_scaling) if target_scaling is not None else None


def dtype_of(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def mesh_from_config(config: ConfigDict, devices=None):
    """The (data, fsdp, context, tensor) mesh over `devices` (default: jax.devices()); fully explicit sizes may use fewer
    devices than there are (warned)."""
    sizes = dict(config.mesh)
    devices = list(jax.devices() if devices is None else devices)
    wanted = int(np.prod(list(sizes.values())))
    if -1 not in sizes.values() and wanted < len(devices):
        # Every process must hold part of the mesh: it feeds its own devices' rows and joins every step.
        _require(jax.process_count() == 1,
                 f"config.mesh {sizes} uses {wanted} of the {len(devices)} devices, but a run of "
                 f"{jax.process_count()} processes must use all of them (set one size to -1)")
        log.warning("config.mesh %s uses %d of %d devices", sizes, wanted, len(devices))
        devices = devices[:wanted]
    context = sizes.get("context", 1)
    _require(config.data.seq_len % context == 0,
             f"config.data.seq_len ({config.data.seq_len}) must be a multiple of config.mesh.context ({context}), "
             f"the devices each row's tokens are split over")
    try:
        return make_mesh(**sizes, devices=devices)
    except ValueError as error:
        raise ConfigError(f"config.mesh: {error}") from None
