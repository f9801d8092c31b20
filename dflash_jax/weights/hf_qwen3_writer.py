"""Write a `dflash_jax.models.qwen3.Qwen3` as a Hugging Face `Qwen3ForCausalLM` directory.

The inverse of `load_target` on a Qwen3 directory: it walks the same weight table backwards, so a
model saved here loads there (and in transformers / vLLM) with the same weights. Kernels go from the JAX
[in, out] layout back to PyTorch's [out, in]; stacked layers are split into `model.layers.{i}.*`; tied
models get no `lm_head.weight`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import transformers
from flax import nnx
from safetensors.numpy import save_file

from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.weights.families import QWEN3
from dflash_jax.weights.mapping import identity, transpose

_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def qwen3_hf_tensors(model: Qwen3) -> dict[str, np.ndarray]:
    """HF tensor name -> fp32 NumPy array in HF layout, for every weight of `model`."""
    flat = {path: variable for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors = {}
    for rule in QWEN3.weight_rules(model.config, "model."):
        # Both load-time fix-ups are their own inverse (a 2-D transpose, or nothing).
        if rule.fixup not in (transpose, identity):
            raise ValueError(f"no inverse known for the fix-up of {rule.hf_name}")
        value = np.asarray(jax.device_get(flat[rule.path][...]), dtype=np.float32)
        if rule.layers is None:
            tensors[rule.hf_name] = np.ascontiguousarray(rule.fixup(value))
        else:
            for index, name in enumerate(rule.names()):
                tensors[name] = np.ascontiguousarray(rule.fixup(value[index]))
    return tensors


def qwen3_hf_config(config: Qwen3Config, *, dtype: str = "bfloat16", **token_ids) -> dict:
    """config.json contents for `config`, built by transformers' own `Qwen3Config`.

    `token_ids` are e.g. bos_token_id / eos_token_id / pad_token_id. Top-level `rope_theta`, `rope_scaling`
    and `torch_dtype` are added next to transformers v5's `rope_parameters` and `dtype` so that older
    readers (transformers v4, vLLM releases pinned to it) see the same settings.
    """
    rope_parameters = {"rope_type": "default", **dict(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    hf_config = transformers.Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_parameters=rope_parameters,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings, dtype=dtype, **token_ids)
    result = json.loads(hf_config.to_json_string(use_diff=True))
    result["architectures"] = ["Qwen3ForCausalLM"]
    result["rope_theta"] = config.rope_theta
    result["rope_scaling"] = dict(config.rope_scaling) if config.rope_scaling else None
    result["torch_dtype"] = dtype
    return result


def save_qwen3(model: Qwen3, out_dir: str | Path, *, dtype: str = "bfloat16", **token_ids) -> Path:
    """Write `config.json` and `model.safetensors` (weights cast to `dtype`) into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    numpy_dtype = _NUMPY_DTYPES[dtype]
    tensors = {name: value.astype(numpy_dtype) for name, value in qwen3_hf_tensors(model).items()}
    # transformers refuses safetensors files whose metadata does not say they hold PyTorch-layout tensors.
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = qwen3_hf_config(model.config, dtype=dtype, **token_ids)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir
