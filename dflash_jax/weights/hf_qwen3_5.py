"""Load a Hugging Face Qwen3.5/3.6 checkpoint (design §8.4) into `Qwen3_5`.

Text weights sit under `model.language_model.` (Qwen3_5ForConditionalGeneration, the released layout) or
`model.` (a text-only Qwen3_5ForCausalLM `save_pretrained`); `lm_head.weight` is unprefixed. The vision tower
(`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are skipped.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.errors import CheckpointError
from dflash_jax.models.qwen3_5 import LINEAR_ATTENTION, Qwen3_5, Qwen3_5Config
from dflash_jax.sharding import state_shardings
from dflash_jax.weights.mapping import WeightRule, identity, load_weights, transpose
from dflash_jax.weights.safetensors_dir import CheckpointReader, read_config

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MULTIMODAL_PREFIX, TEXT_ONLY_PREFIX = "model.language_model.", "model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


def squeeze_conv(x: np.ndarray) -> np.ndarray:
    """Depthwise Conv1d weight [C, 1, K] -> [C, K]. Other shapes pass through to fail the shape check."""
    return x[:, 0, :] if x.ndim == 3 and x.shape[1] == 1 else x


_SHARED = (  # in every decoder layer: (HF suffix, NNX path below the layer, fix-up)
    ("input_layernorm.weight", ("input_layernorm", "weight"), identity),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), identity),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), transpose),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), transpose),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), transpose),
)
_LINEAR_ATTENTION = (
    *((f"linear_attn.{name}.weight", ("linear_attn", name, "kernel"), transpose)
      for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")),
    ("linear_attn.conv1d.weight", ("linear_attn", "conv1d", "weight"), squeeze_conv),
    ("linear_attn.dt_bias", ("linear_attn", "dt_bias"), identity),
    ("linear_attn.A_log", ("linear_attn", "A_log"), identity),
    ("linear_attn.norm.weight", ("linear_attn", "norm", "weight"), identity),
)
_FULL_ATTENTION = (
    *((f"self_attn.{name}.weight", ("self_attn", name, "kernel"), transpose)
      for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("self_attn.q_norm.weight", ("self_attn", "q_norm", "weight"), identity),
    ("self_attn.k_norm.weight", ("self_attn", "k_norm", "weight"), identity),
)


def weight_rules(config: Qwen3_5Config, prefix: str) -> list[WeightRule]:
    """HF tensor -> NNX variable table. HF layer i is position i % p of the period, repetition i // p."""
    period = config.layer_period()
    repeats = config.num_hidden_layers // len(period)
    rules = [WeightRule(f"{prefix}embed_tokens.weight", ("embed_tokens", "embedding")),
             WeightRule(f"{prefix}norm.weight", ("norm", "weight"))]
    if not config.tie_word_embeddings:
        rules.append(WeightRule("lm_head.weight", ("lm_head", "kernel"), transpose))
    for position, layer_type in enumerate(period):
        mixer = _LINEAR_ATTENTION if layer_type == LINEAR_ATTENTION else _FULL_ATTENTION
        layers = [position + repeat * len(period) for repeat in range(repeats)]
        for suffix, path, fixup in (*_SHARED, *mixer):
            rules.append(WeightRule(f"{prefix}layers.{{layer}}.{suffix}", ("periods", "layers", position, *path),
                                    fixup, layers=layers))
    return rules


def load_qwen3_5(checkpoint_dir: str | Path, *, param_dtype=jnp.bfloat16, mesh: Mesh | None = None,
                 attention_impl: str = "xla") -> tuple[Qwen3_5, Qwen3_5Config]:
    """Read config.json and the safetensors into a `Qwen3_5`; returns (model, config). attention_impl: the
    backend of its attention layers (see `Qwen3_5`).

    A_log and dt_bias stay fp32 whatever param_dtype. With a mesh, each weight goes straight to its sharding.
    Raises CheckpointError naming missing tensors, unexpected tensors and shape mismatches.
    """
    config_path = Path(checkpoint_dir) / "config.json"
    config_dict = read_config(checkpoint_dir)
    if config_dict.get("model_type") not in MODEL_TYPES:
        raise CheckpointError(f"{config_path}: model_type {config_dict.get('model_type')!r} is not one of "
                              f"{', '.join(MODEL_TYPES)}")
    try:
        config = Qwen3_5Config.from_hf(config_dict)
    except ValueError as error:
        raise CheckpointError(f"{config_path}: {error}") from None
    reader = CheckpointReader(checkpoint_dir)
    multimodal = any(name.startswith(MULTIMODAL_PREFIX) for name in reader.names())
    prefix = MULTIMODAL_PREFIX if multimodal else TEXT_ONLY_PREFIX
    ignored = SKIPPED_PREFIXES
    if config.tie_word_embeddings:
        ignored += ("lm_head.weight",)  # a tied checkpoint may still carry the copy
    abstract = nnx.eval_shape(lambda: Qwen3_5(config, param_dtype=param_dtype, rngs=nnx.Rngs(0),
                                              attention_impl=attention_impl))
    shardings = state_shardings(nnx.state(abstract), mesh) if mesh is not None else None
    model = load_weights(abstract, reader, weight_rules(config, prefix), ignore_prefixes=ignored,
                         shardings=shardings)
    return model, config
