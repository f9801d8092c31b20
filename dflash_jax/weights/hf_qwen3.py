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
    config's sparse layers take the router and the experts in the checkpoint's layout (`hf_moe.py`). With dense
    layers among sparse ones the MLPs are stacked apart, over the layers of their kind (`Qwen3.dense_mlps`,
    `sparse_mlps`)."""
    layers = list(range(config.num_hidden_layers))
    moe = config.moe
    dense = [(name, path, fixup, None) for name, path, fixup in _DENSE_MLP_TENSORS]
    if config.mixed_mlps:
        sparse_layers = [i for i in layers if moe.sparse_layers[i]]
        dense_layers = [i for i in layers if not moe.sparse_layers[i]]
        mlps = [(name, ("dense_mlps", *path[1:]), fixup, dense_layers, experts)
                for name, path, fixup, experts in dense]
        mlps += [(name, ("sparse_mlps", *path[1:]), fixup, sparse_layers, experts)
                 for name, path, fixup, experts in moe_tensors(moe, config.hidden_size, fused_experts)]
    else:
        every_sparse = moe is not None and moe.sparse_layers[0]
        layer_mlp = moe_tensors(moe, config.hidden_size, fused_experts) if every_sparse else dense
        mlps = [(name, ("layers", *path), fixup, layers, experts) for name, path, fixup, experts in layer_mlp]
    return [
        WeightRule(f"{prefix}embed_tokens.weight", ("embed_tokens", "embedding")),
        *(WeightRule(f"{prefix}layers.{{layer}}.{name}", ("layers", *path), fixup, layers)
          for name, path, fixup in _LAYER_TENSORS),
        *(WeightRule(f"{prefix}layers.{{layer}}.{name}", path, fixup, stack, experts)
          for name, path, fixup, stack, experts in mlps),
        WeightRule(f"{prefix}norm.weight", ("norm", "weight")),
    ]
