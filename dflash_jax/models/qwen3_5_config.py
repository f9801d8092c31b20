"""Qwen3.5/3.6 text-model configuration (transformers `Qwen3_5TextConfig`, models/qwen3_5/configuration_qwen3_5.py),
and of its mixture-of-experts variant (`Qwen3_5MoeTextConfig`, `qwen3_5_moe`: the same layers with every MLP
replaced by routed experts and a shared expert, design §8.5)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from dflash_jax.models.layers import decoder_layer_params, rope_frequencies, rope_type_of
from dflash_jax.models.moe_config import MoeSettings

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")  # the multimodal wrapper and its text config
_POSITIVE_INTS = (*_REQUIRED, "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                  "max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's; 0 with `moe` (a qwen3_5_moe config has no dense MLP)
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]  # one of LINEAR_ATTENTION / FULL_ATTENTION per layer
    num_key_value_heads: int = 4
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25  # RoPE rotates the first head_dim * factor features of each head
    rope_scaling: Mapping | None = dataclasses.field(default=None, hash=False)  # None = default RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    moe: MoeSettings | None = None  # qwen3_5_moe: every layer's MLP is routed experts + a shared expert

    def __post_init__(self):
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen3.5 config field {name!r} must be a positive integer, got {value!r}")
        dense = self.intermediate_size
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0 or (dense == 0) != bool(self.moe):
            raise ValueError(f"Qwen3.5 config field 'intermediate_size' must be a positive integer (0 only for a "
                             f"qwen3_5_moe config, which has no dense MLP), got {dense!r}")
        if self.moe is not None and (not self.moe.has_shared_expert or not all(self.moe.sparse_layers)
                                     or len(self.moe.sparse_layers) != self.num_hidden_layers):
            raise ValueError("qwen3_5_moe settings must make every layer sparse with a shared expert "
                             "(MoeSettings.from_qwen3_5_moe)")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Qwen3.5 config field {name!r} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Qwen3.5 config field 'num_attention_heads' ({self.num_attention_heads}) must be a "
                             f"multiple of 'num_key_value_heads' ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"Qwen3.5 config field 'linear_num_value_heads' ({self.linear_num_value_heads}) must "
                             f"be a multiple of 'linear_num_key_heads' ({self.linear_num_key_heads})")
        rotary_dim = self.rotary_dim
        if self.partial_rotary_factor > 1 or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"Qwen3.5 config field 'partial_rotary_factor' ({self.partial_rotary_factor}) gives "
                             f"rotary dim {rotary_dim} of head_dim {self.head_dim}; it must be even, >= 2 and "
                             f"<= head_dim")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"Qwen3.5 config field 'tie_word_embeddings' must be a bool, "
                             f"got {self.tie_word_embeddings!r}")
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"Qwen3.5 config field 'layer_types' must list one type per layer "
                             f"({self.num_hidden_layers}), got {self.layer_types!r}")
        unknown = sorted({t for t in self.layer_types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)}, key=str)
        if unknown:
            raise ValueError(f"Qwen3.5 config field 'layer_types' has unsupported type(s) {unknown}; expected "
                             f"{LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # HF truncates the same way

    @property
    def layer_matmul_params(self) -> int:
        """Weights every token is multiplied by in the decoder layers (projections, the MLP and the depthwise
        convolution; not the embedding or the LM head), for FLOP counts. With `moe`, the MLP is the k routed
        experts a token reaches, the router and the gated shared expert (design §8.5)."""
        hidden = self.hidden_size
        mlps = (self.moe.active_mlp_params(hidden, self.intermediate_size) if self.moe is not None
                else (3 * hidden * self.intermediate_size,) * self.num_hidden_layers)
        # q_proj yields [query | gate]: one more q-sized projection than a Qwen3 layer.
        attention = decoder_layer_params(hidden, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                                         0) + hidden * self.num_attention_heads * self.head_dim
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        mixed = 2 * key_dim + value_dim
        delta_net = (hidden * (mixed + value_dim + 2 * self.linear_num_value_heads) + value_dim * hidden
                     + mixed * self.linear_conv_kernel_dim)  # in_proj_qkv, z, b, a; out_proj; conv1d
        return sum(mlp + (attention if kind == FULL_ATTENTION else delta_net)
                   for mlp, kind in zip(mlps, self.layer_types))

    @property
    def attention_layers(self) -> int:
        """Layers with softmax attention over the sequence (the Gated DeltaNet layers are linear in T)."""
        return sum(kind == FULL_ATTENTION for kind in self.layer_types)

    def layer_period(self) -> tuple[str, ...]:
        """The shortest prefix of layer_types whose repetition is layer_types (all of it if none shorter)."""
        layers = self.num_hidden_layers
        for period in range(1, layers + 1):
            if layers % period == 0 and self.layer_types[:period] * (layers // period) == self.layer_types:
                return self.layer_types[:period]
        raise AssertionError("unreachable: the whole list is its own period")

    @classmethod
    def from_hf(cls, config: Mapping) -> Qwen3_5Config:
        """From a Hugging Face config.json dict: the multimodal wrapper (reads `text_config`) or a flat text
        config; a `qwen3_5_moe` / `qwen3_5_moe_text` one has experts and no dense MLP. Absent optional fields
        take transformers' `Qwen3_5TextConfig` defaults."""
        text = config.get("text_config", config)
        if not isinstance(text, Mapping):
            raise ValueError(f"Qwen3.5 config field 'text_config' must be an object, got {text!r}")
        is_moe = config.get("model_type") in MOE_MODEL_TYPES
        required = _REQUIRED if is_moe else (*_REQUIRED, "intermediate_size")
        missing = [name for name in required if text.get(name) is None]
        if missing:
            raise ValueError(f"Qwen3.5 config is missing required field(s): {', '.join(missing)}")
        if text.get("attention_bias"):
            raise ValueError("Qwen3.5 config field 'attention_bias' is true; Qwen3.5 attention has no biases")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3.5 config field 'hidden_act' must be 'silu', got {text['hidden_act']!r}")
        theta, partial, scaling = _rope_settings(text)
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
                raise ValueError(f"Qwen3.5 config field 'full_attention_interval' must be a positive integer, "
                                 f"got {interval!r}")
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                           for i in range(text["num_hidden_layers"])]
        elif not isinstance(layer_types, (list, tuple)):
            raise ValueError(f"Qwen3.5 config field 'layer_types' must be a list, got {layer_types!r}")
        # The multimodal wrapper's own flag decides tying there (transformers reads the top-level config).
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        optional = {name: text[name] for name in (
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
            "max_position_embeddings") if text.get(name) is not None}
        moe = MoeSettings.from_qwen3_5_moe(text, text["num_hidden_layers"]) if is_moe else None
        return cls(**{name: text[name] for name in _REQUIRED}, **optional, layer_types=tuple(layer_types),
                   rope_theta=theta, partial_rotary_factor=partial, rope_scaling=scaling, tie_word_embeddings=tied,
                   intermediate_size=0 if is_moe else text["intermediate_size"], moe=moe)


def _rope_settings(text: Mapping) -> tuple[float, float, dict | None]:
    """(rope_theta, partial_rotary_factor, rope_scaling or None for default RoPE) from `rope_parameters` (transformers v5) or the older top-level
    `rope_theta` / `partial_rotary_factor` / `rope_scaling`. mRoPE sections are ignored: for text-only input
    interleaved mRoPE is exactly 1-D RoPE (design §8.2)."""
    rope = text.get("rope_parameters")
    if rope is None:
        rope = {**(text.get("rope_scaling") or {})}
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in text:
                rope.setdefault(key, text[key])
    if not isinstance(rope, Mapping):
        raise ValueError(f"Qwen3.5 config field 'rope_parameters' must be an object, got {rope!r}")
    theta = rope.get("rope_theta", 10000.0)
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    scaling = {key: value for key, value in rope.items() if key not in ("rope_theta", "partial_rotary_factor")}
    if rope_type_of(scaling) == "default":
        return theta, partial, None
    rope_frequencies(2, theta, scaling, text.get("max_position_embeddings"))  # refuses unsupported types now
    return theta, partial, scaling
