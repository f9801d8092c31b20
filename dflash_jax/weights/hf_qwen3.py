"""The Hugging Face tensor names of a Qwen3 (`model_type` qwen3) target, as `dflash_jax.models.qwen3.Qwen3`
holds them (its family entry, with the LM head rule, is in weights/families.py)."""

from __future__ import annotations

from dflash_jax.models.qwen3 import Qwen3Config
from dflash_jax.weights.hf_moe import moe_tensors
from dflash_jax.weights.mapping import WeightRule, identity, transpose

# HF name under `<prefix>layers.{layer}.` -> NNX path under `layers` (stacked over layers), fix-up.
_LAYER_TENSORS = (
    ("input_layernorm.weight", ("input_layernorm", "weight"), identity),
    ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), transpose),
    ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), transpose),
    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), transpose),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), transpose),
    ("self_attn.q_norm.weight", ("self_attn", "q_norm", "weight"), identity),
    ("self_attn.k_norm.weight", ("self_attn", "k_norm", "weight"), identity),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), identity),
)
_DENSE_MLP_TENSORS = (
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), transpose),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), transpose),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), transpose),
)


def text_rules(config: Qwen3Config, prefix: str, fused_experts: bool = False) -> list[WeightRule]:
    """The embedding, the decoder layers (stacked along `layers`) and the final norm under `prefix`; a qwen3_moe
    config's sparse layers take the router and the experts in the checkpoint's layout (`hf_moe.py`)."""
    layers = range(config.num_hidden_layers)
    moe = config.moe
    if moe is not None and moe.sparse_layers[0]:
        mlp = moe_tensors(moe, config.hidden_size, fused_experts)
    else:
        mlp = [(name, path, fixup, None) for name, path, fixup in _DENSE_MLP_TENSORS]
    return [
        WeightRule(f"{prefix}embed_tokens.weight", ("embed_tokens", "embedding")),
        *(WeightRule(f"{prefix}layers.{{layer}}.{name}", ("layers", *path), fixup, layers)
          for name, path, fixup in _LAYER_TENSORS),
        *(WeightRule(f"{prefix}layers.{{layer}}.{name}", ("layers", *path), fixup, layers, experts)
          for name, path, fixup, experts in mlp),
        WeightRule(f"{prefix}norm.weight", ("norm", "weight")),
    ]
