"""Load a Hugging Face Qwen3 (`model_type` qwen3) checkpoint directory into `dflash_jax.models.qwen3.Qwen3`."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.errors import CheckpointError
from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.sharding import state_shardings
from dflash_jax.weights.mapping import WeightRule, identity, load_weights, transpose
from dflash_jax.weights.safetensors_dir import CheckpointReader, read_config

# HF name under `model.layers.{layer}.` -> NNX path under `layers` (stacked over layers), fix-up.
_LAYER_TENSORS = (
    ("input_layernorm.weight", ("input_layernorm", "weight"), identity),
    ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), transpose),
    ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), transpose),
    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), transpose),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), transpose),
    ("self_attn.q_norm.weight", ("self_attn", "q_norm", "weight"), identity),
    ("self_attn.k_norm.weight", ("self_attn", "k_norm", "weight"), identity),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), identity),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), transpose),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), transpose),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), transpose),
)


def qwen3_weight_rules(config: Qwen3Config) -> list[WeightRule]:
    layers = range(config.num_hidden_layers)
    rules = [
        WeightRule("model.embed_tokens.weight", ("embed_tokens", "embedding")),
        *(WeightRule(f"model.layers.{{layer}}.{name}", ("layers", *path), fixup, layers)
          for name, path, fixup in _LAYER_TENSORS),
        WeightRule("model.norm.weight", ("norm", "weight")),
    ]
    if not config.tie_word_embeddings:
        rules.append(WeightRule("lm_head.weight", ("lm_head", "kernel"), transpose))
    return rules


def load_qwen3(checkpoint_dir: str | Path, *, param_dtype=jnp.bfloat16, mesh: Mesh | None = None,
               attention_impl: str = "xla") -> tuple[Qwen3, Qwen3Config]:
    """Read config.json and the safetensors weights; with a mesh each weight is placed on its sharding.
    attention_impl: the backend of the model's full-sequence forward (see `Qwen3`).

    Raises CheckpointError (naming the file, tensor and shapes involved) for anything unusable.
    """
    config_path = Path(checkpoint_dir) / "config.json"
    config_dict = read_config(checkpoint_dir)
    if config_dict.get("model_type") != "qwen3":
        raise CheckpointError(f"{config_path}: model_type {config_dict.get('model_type')!r} is not 'qwen3'")
    try:
        config = Qwen3Config.from_hf(config_dict)
    except ValueError as error:
        raise CheckpointError(f"{config_path}: {error}") from None
    reader = CheckpointReader(checkpoint_dir)
    abstract = nnx.eval_shape(lambda: Qwen3(config, param_dtype=param_dtype, rngs=nnx.Rngs(0),
                                            attention_impl=attention_impl))
    shardings = state_shardings(nnx.state(abstract), mesh) if mesh is not None else None
    # Tied checkpoints normally omit lm_head.weight; if one is present anyway, the embedding wins (as in HF).
    ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
    model = load_weights(abstract, reader, qwen3_weight_rules(config), ignore_prefixes=ignore, shardings=shardings)
    return model, config
