"""Mixture-of-experts settings of the Qwen MoE targets, read from config.json (design §8.5).

`qwen3_moe` (transformers `Qwen3MoeConfig`): layer i is sparse iff i is not in `mlp_only_layers`, `num_experts`
> 0 and (i + 1) % `decoder_sparse_step` == 0; other layers keep the dense MLP of `intermediate_size`; the top-k
weights are renormalised only when `norm_topk_prob`; no shared expert. `qwen3_5_moe` (`Qwen3_5MoeTextConfig`):
every layer is sparse, the top-k weights are always renormalised (the model divides by their sum
unconditionally), and every layer adds a shared expert of `shared_expert_intermediate_size` scaled by its
sigmoid gate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class MoeSettings:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool
    sparse_layers: tuple[bool, ...]  # one per decoder layer: routed experts (True) or the dense MLP (False)
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoE config field {name!r} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoE config field 'num_experts_per_tok' ({self.top_k}) exceeds 'num_experts' "
                             f"({self.num_experts})")
        value = self.shared_expert_intermediate_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"MoE config field 'shared_expert_intermediate_size' must be a non-negative integer, "
                             f"got {value!r}")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def active_mlp_params(self, hidden_size: int, dense_intermediate_size: int) -> tuple[int, ...]:
        """Per layer, the feed-forward weights one token is multiplied by: its k experts, the shared expert and
        its gate, the router (sparse layers) or the dense MLP, for FLOP counts (only active experts count)."""
        routed = (3 * self.top_k * self.expert_intermediate_size * hidden_size + self.num_experts * hidden_size
                  + (3 * self.shared_expert_intermediate_size + 1) * hidden_size * self.has_shared_expert)
        return tuple(routed if sparse else 3 * hidden_size * dense_intermediate_size
                     for sparse in self.sparse_layers)

    @classmethod
    def from_qwen3_moe(cls, config: Mapping, num_layers: int) -> MoeSettings:
        """From a `qwen3_moe` config.json dict. transformers writes `num_local_experts` (its attribute_map
        aliases num_experts to it); the published checkpoints write `num_experts`."""
        experts = config.get("num_experts", config.get("num_local_experts"))
        _require(config, experts, "num_experts_per_tok", "moe_intermediate_size")
        step = config.get("decoder_sparse_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
            raise ValueError(f"MoE config field 'decoder_sparse_step' must be a positive integer, got {step!r}")
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, (list, tuple)) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in dense):
            raise ValueError(f"MoE config field 'mlp_only_layers' must list layer indices in [0, {num_layers}), "
                             f"got {dense!r}")
        normalize = config.get("norm_topk_prob", False)
        if not isinstance(normalize, bool):
            raise ValueError(f"MoE config field 'norm_topk_prob' must be a bool, got {normalize!r}")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        return cls(num_experts=experts, top_k=config["num_experts_per_tok"],
                   expert_intermediate_size=config["moe_intermediate_size"], normalize_top_k=normalize,
                   sparse_layers=sparse)

    @classmethod
    def from_qwen3_5_moe(cls, text: Mapping, num_layers: int) -> MoeSettings:
        """From a `qwen3_5_moe` text config dict (the caller unwraps `text_config`)."""
        _require(text, text.get("num_experts"), "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size")
        shared = text["shared_expert_intermediate_size"]
        if isinstance(shared, bool) or not isinstance(shared, int) or shared <= 0:
            raise ValueError(f"MoE config field 'shared_expert_intermediate_size' must be a positive integer, "
                             f"got {shared!r}")
        return cls(num_experts=text["num_experts"], top_k=text["num_experts_per_tok"],
                   expert_intermediate_size=text["moe_intermediate_size"], normalize_top_k=True,
                   sparse_layers=(True,) * num_layers, shared_expert_intermediate_size=shared)


def _require(config: Mapping, experts, *names: str) -> None:
    missing = ["num_experts"] * (experts is None) + [name for name in names if config.get(name) is None]
    if missing:
        raise ValueError(f"MoE config is missing required field(s): {', '.join(missing)}")
