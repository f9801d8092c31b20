"""Tiny random Hugging Face checkpoints written with `save_pretrained`, for parity and loader tests.

Every parameter is randomised, norm weights included: HF initialises norms to an identity, which would hide
a wrong norm formula.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file


def randomize_parameters(model: torch.nn.Module, *, seed: int = 0, scale: float = 0.1,
                         norm_offset: float = 1.0) -> torch.nn.Module:
    """In place: every parameter ~ N(0, scale²); parameters whose name contains 'norm' get `norm_offset` added."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale
            parameter.copy_(noise + norm_offset if "norm" in name else noise)
    return model


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def hf_forward(model: torch.nn.Module, input_ids) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Logits, `hidden_states` and each decoder layer's own output (HF's last hidden state is final-normed), for
    a causal LM or a multimodal model (its text model's layers)."""
    layer_outputs = []
    text_model = getattr(model.model, "language_model", model.model)
    hooks = [layer.register_forward_hook(lambda _m, _i, out: layer_outputs.append(out[0] if isinstance(out, tuple)
                                                                                  else out))
             for layer in text_model.layers]
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(input_ids)), output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states], [h.numpy() for h in layer_outputs]


def qwen3_config(**overrides) -> transformers.Qwen3Config:
    """A tiny Qwen3 config: GQA 4/2, head_dim 24 != hidden/heads, untied, θ 1e4. Override any field."""
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    fields.update(overrides)
    return transformers.Qwen3Config(**fields)


def save_qwen3(directory: str | Path, config: transformers.Qwen3Config | None = None, *, seed: int = 0,
               max_shard_size: str | int | None = None) -> transformers.Qwen3ForCausalLM:
    """Build a random fp32 `Qwen3ForCausalLM`, save it (safetensors) to `directory` and return it in eval mode.

    `max_shard_size` (e.g. "20KB") makes a sharded checkpoint with model.safetensors.index.json.
    """
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config or qwen3_config()).to(torch.float32).eval()
    randomize_parameters(model, seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return model


# Qwen3.5: value/key head ratio 3 like the 27B, two periods of [GDN, GDN, GDN, attention].
QWEN3_5_TEXT_CONFIG = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
    linear_value_head_dim=24, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN3_5_VISION_CONFIG = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                             num_position_embeddings=16)


def randomize_qwen3_5(model: torch.nn.Module, seed: int) -> None:
    """Every weight of a Qwen3.5 (dense or MoE) random, norms included: 1p-norm weights away from 0 and the
    gated norm away from 1, so `w` vs `1 + w` mistakes cannot hide. Matrices use HF's initializer_range 0.02:
    larger random weights make an 8-layer net so sensitive that HF's own fp32 drifts ~1e-4 from a float64
    reference, which would leave no margin for the 1e-4 check."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = param.shape
            sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
            magnitude = 0.3 + 0.5 * torch.rand(shape, generator=generator)
            if name.endswith("linear_attn.norm.weight"):
                value = 1.0 + sign * magnitude
            elif name.endswith("norm.weight"):
                value = sign * magnitude
            elif name.endswith("A_log"):
                value = torch.log(1.0 + 15.0 * torch.rand(shape, generator=generator))
            elif name.endswith("dt_bias"):
                value = torch.randn(shape, generator=generator)
            elif name.endswith("conv1d.weight"):
                value = 0.3 * torch.randn(shape, generator=generator)
            else:
                value = 0.02 * torch.randn(shape, generator=generator)
            param.copy_(value)


# Qwen3.5-MoE: one period of [GDN, GDN, GDN, attention], 6 experts of which 2 per token, a shared expert.
QWEN3_5_MOE_TEXT_CONFIG = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6,
    num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def save_qwen3_5_moe(directory: str | Path, *, multimodal: bool = False, seed: int = 0,
                     **overrides) -> torch.nn.Module:
    """A random fp32 Qwen3_5MoeForCausalLM (`model.*`, `qwen3_5_moe_text`) or, `multimodal`,
    Qwen3_5MoeForConditionalGeneration (`model.language_model.*`, the config under `text_config`), saved by
    transformers (experts per expert) and returned in eval mode; `overrides` replace text config fields."""
    text = {**QWEN3_5_MOE_TEXT_CONFIG, **overrides}
    if multimodal:
        config = transformers.Qwen3_5MoeConfig(text_config=text, tie_word_embeddings=text["tie_word_embeddings"],
                                               vision_config=QWEN3_5_VISION_CONFIG | {"out_hidden_size": 32})
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    model = model.to(torch.float32).eval()
    randomize_qwen3_5(model, seed=seed)
    model.save_pretrained(directory)
    return model


def fuse_experts(source: Path, destination: Path) -> Path:
    """A copy of a single-file checkpoint with per-expert tensors in the published Qwen3.5-MoE layout:
    per layer `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and `mlp.experts.down_proj` [E, H, I]."""
    tensors = load_file(source / "model.safetensors")
    fused, experts = {}, {}
    for name, value in tensors.items():
        match = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if match is None:
            fused[name] = value
        else:
            experts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = value
    for layer, parts in experts.items():
        stack = {part: np.stack([pieces[e] for e in sorted(pieces)]) for part, pieces in parts.items()}
        fused[f"{layer}.gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
        fused[f"{layer}.down_proj"] = stack["down_proj"]
    destination.mkdir()
    shutil.copy(source / "config.json", destination / "config.json")
    save_file(fused, destination / "model.safetensors", metadata={"format": "pt"})
    return destination
