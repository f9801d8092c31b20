"""Tiny random Hugging Face checkpoints written with `save_pretrained`, for parity and loader tests.

Every parameter is randomised, norm weights included: HF initialises norms to an identity, which would hide
a wrong norm formula.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def randomize_parameters(model: torch.nn.Module, *, seed: int = 0, scale: float = 0.1,
                         norm_offset: float = 1.0) -> torch.nn.Module:
    """In place: every parameter ~ N(0, scale²); parameters whose name contains 'norm' get `norm_offset` added."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale
            parameter.copy_(noise + norm_offset if "norm" in name else noise)
    return model


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
