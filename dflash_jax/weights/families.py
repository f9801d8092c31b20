"""The target families: Hugging Face `model_type` -> config class, model class and weight table.

The one place that knows which targets exist. Loading an HF directory (`weights/targets.py`), converting it
to Orbax and restoring that (`weights/orbax_target.py`) all start from `resolve`. A family's Orbax layout is
its model's own NNX variables, stored under their paths, so it needs no table of its own.

Every family shares the LM head rule: `lm_head.weight` when untied; when tied the embedding is the head, and
a checkpoint that still carries an `lm_head.weight` copy has it ignored (as transformers does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from dflash_jax.weights import hf_qwen3, hf_qwen3_5
from dflash_jax.weights.hf_moe import has_fused_experts
from dflash_jax.weights.mapping import WeightRule, transpose

LM_HEAD = "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class TargetFamily:
    """How one kind of target is read: its config from config.json, its NNX model, its HF tensor names."""

    config_type: type  # its config class; config_type.from_hf(config.json dict) raises ValueError naming the field
    model: type[nnx.Module]  # model(config, param_dtype=, rngs=, attention_impl=, mesh=)
    # embedding, decoder layers, final norm: text_rules(config, prefix, fused_experts) (weights/hf_moe.py layouts)
    text_rules: Callable[[Any, str, bool], list[WeightRule]]
    prefixes: tuple[str, ...] = ("model.",)  # where the text model's tensors may sit, most specific first
    skipped: tuple[str, ...] = ()  # tensors of parts a target does not use (a vision tower, an MTP head)
    delta_rule: bool = False  # Gated DeltaNet layers: the model takes delta_rule_dtype (design §8.3)

    def config_from_hf(self, hf_config: Mapping) -> Any:
        return self.config_type.from_hf(hf_config)

    def prefix(self, names: Sequence[str]) -> str:
        """The prefix the checkpoint's tensors use: the first of `prefixes` any name starts with."""
        return next((p for p in self.prefixes if any(name.startswith(p) for name in names)), self.prefixes[-1])

    def weight_rules(self, config, prefix: str, fused_experts: bool = False) -> list[WeightRule]:
        """HF tensor -> NNX variable, the LM head included when untied."""
        rules = self.text_rules(config, prefix, fused_experts)
        if not config.tie_word_embeddings:
            rules.append(WeightRule(LM_HEAD, ("lm_head", "kernel"), transpose))
        return rules

    def checkpoint_rules(self, config, names: Collection[str]) -> list[WeightRule]:
        """The weight rules of a checkpoint holding tensors `names`: its prefix and expert layout read off them."""
        return self.weight_rules(config, self.prefix(names), has_fused_experts(names))

    def ignored(self, config) -> tuple[str, ...]:
        """Prefixes of checkpoint tensors that are read by no rule and are not an error."""
        return self.skipped + ((LM_HEAD,) if config.tie_word_embeddings else ())

    def abstract_model(self, config, *, param_dtype, attention_impl: str = "xla", mesh: Mesh | None = None,
                       delta_rule_dtype: str = "float32") -> nnx.Module:
        """The model's structure with shapes and dtypes only (`nnx.eval_shape`), to be filled with weights.
        delta_rule_dtype: config.target_matmul_dtype, for a family with Gated DeltaNet layers."""
        options = {"delta_rule_dtype": delta_rule_dtype} if self.delta_rule else {}
        return nnx.eval_shape(lambda: self.model(config, param_dtype=param_dtype, rngs=nnx.Rngs(0),
                                                 attention_impl=attention_impl, mesh=mesh, **options))


QWEN3 = TargetFamily(Qwen3Config, Qwen3, hf_qwen3.text_rules)
QWEN3_5 = TargetFamily(Qwen3_5Config, Qwen3_5, hf_qwen3_5.text_rules,
                       prefixes=(hf_qwen3_5.MULTIMODAL_PREFIX, hf_qwen3_5.TEXT_ONLY_PREFIX),
                       skipped=hf_qwen3_5.SKIPPED_PREFIXES, delta_rule=True)
# A MoE model_type selects the same family: its config then carries `moe` (models/moe_config.py).
FAMILIES = {"qwen3": QWEN3, "qwen3_moe": QWEN3, "qwen3_5": QWEN3_5, "qwen3_5_text": QWEN3_5,
            "qwen3_5_moe": QWEN3_5, "qwen3_5_moe_text": QWEN3_5}


def family_of(config) -> TargetFamily:
    """The family of a target config built in code (a config file's target_config()) rather than read."""
    family = next((f for f in FAMILIES.values() if isinstance(config, f.config_type)), None)
    if family is None:
        raise CheckpointError(f"no target family has the config type {type(config).__name__}")
    return family


def resolve(hf_config: Mapping, config_path: str | Path) -> tuple[TargetFamily, Any]:
    """(family, parsed config) of a config.json dict; CheckpointError naming `config_path` otherwise."""
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(f"{config_path}: unsupported model_type {model_type!r}; supported: "
                              f"{', '.join(FAMILIES)}")
    family = FAMILIES[model_type]
    try:
        return family, family.config_from_hf(hf_config)
    except ValueError as error:
        raise CheckpointError(f"{config_path}: {error}") from None
