"""The Hugging Face tensor names of a Qwen3.5/3.6 target (design §8.4), dense or MoE (§8.5), as
`dflash_jax.models.qwen3_5.Qwen3_5` holds them (its family entry, with the LM head rule, is in
weights/families.py).

Text weights sit under `model.language_model.` (Qwen3_5ForConditionalGeneration, the released layout) or
`model.` (a text-only Qwen3_5ForCausalLM `save_pretrained`); `lm_head.weight` is unprefixed. The vision tower
(`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are skipped.
"""

from __future__ import annotations

import numpy as np

from dflash_jax.models.qwen3_5 import LINEAR_ATTENTION, Qwen3_5Config
from dflash_jax.weights.hf_moe import moe_tensors
from dflash_jax.weights.mapping import WeightRule, identity, transpose

MULTIMODAL_PREFIX, TEXT_ONLY_PREFIX = "model.language_model.", "model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


_NORMS = (  # in every decoder layer: (HF suffix, NNX path below the layer, fix-up)
    ("input_layernorm.weight", ("input_layernorm", "weight"), identity),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), identity),
)
_DENSE_MLP = (
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), transpose),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), transpose),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), transpose),
)
_LINEAR_ATTENTION = (
    *((f"linear_attn.{name}.weight", ("linear_attn", name, "kernel"), transpose)
      for name in ("in_proj_z", "in_proj_b", "in_proj_a", "out_proj")),
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


def _split_qkv(config: Qwen3_5Config) -> tuple:
    """HF's fused in_proj_qkv [2·key_dim + value_dim, H] and conv1d [same, 1, K] hold q, k and v as row blocks;
    the model holds each block as its own weight (models/gated_deltanet.py)."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    fused = 2 * key_dim + config.linear_num_value_heads * config.linear_value_head_dim
    in_proj_shape, conv_shape = (fused, config.hidden_size), (fused, 1, config.linear_conv_kernel_dim)
    blocks = {"q": slice(0, key_dim), "k": slice(key_dim, 2 * key_dim), "v": slice(2 * key_dim, fused)}
    rules = []
    for part, rows in blocks.items():
        rules.append(("linear_attn.in_proj_qkv.weight", ("linear_attn", f"in_proj_{part}", "kernel"),
                      lambda x, rows=rows: _fused_rows(x, rows, in_proj_shape).T))
        rules.append(("linear_attn.conv1d.weight", ("linear_attn", f"conv1d_{part}", "weight"),
                      lambda x, rows=rows: _fused_rows(x, rows, conv_shape)[:, 0, :]))
    return tuple(rules)


def _fused_rows(x: np.ndarray, rows: slice, fused_shape: tuple[int, ...]) -> np.ndarray:
    """Rows `rows` of a fused q|k|v tensor, whose whole shape is checked here (the loader would otherwise
    compare one block's shape and name that in its message)."""
    if tuple(x.shape) != fused_shape:
        raise ValueError(f"has shape {tuple(x.shape)}, expected {fused_shape} for this config "
                         "(q, k and v fused)")
    return x[rows]


def text_rules(config: Qwen3_5Config, prefix: str, fused_experts: bool = False) -> list[WeightRule]:
    """The embedding, the decoder layers and the final norm under `prefix`. HF layer i is position i % p of
    the period, repetition i // p. A qwen3_5_moe config's layers take the router, the experts in the
    checkpoint's layout and the shared expert (`hf_moe.py`)."""
    period = config.layer_period()
    repeats = config.num_hidden_layers // len(period)
    if config.moe is not None:
        mlp = moe_tensors(config.moe, config.hidden_size, fused_experts)
    else:
        mlp = [(name, path, fixup, None) for name, path, fixup in _DENSE_MLP]
    rules = [WeightRule(f"{prefix}embed_tokens.weight", ("embed_tokens", "embedding")),
             WeightRule(f"{prefix}norm.weight", ("norm", "weight"))]
    for position, layer_type in enumerate(period):
        mixer = (*_LINEAR_ATTENTION, *_split_qkv(config)) if layer_type == LINEAR_ATTENTION else _FULL_ATTENTION
        layers = [position + repeat * len(period) for repeat in range(repeats)]
        tensors = [(name, path, fixup, None) for name, path, fixup in (*_NORMS, *mixer)] + mlp
        for suffix, path, fixup, experts in tensors:
            rules.append(WeightRule(f"{prefix}layers.{{layer}}.{suffix}", ("periods", "layers", position, *path),
                                    fixup, layers=layers, experts=experts))
    return rules
