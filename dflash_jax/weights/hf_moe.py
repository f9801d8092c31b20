"""The Hugging Face tensor names of a Qwen MoE layer's feed-forward (design §8.5), as `models/moe.py`'s
`SparseMoE` holds them; shared by the qwen3_moe (`hf_qwen3.py`) and qwen3_5_moe (`hf_qwen3_5.py`) tables.

Experts come in two layouts. Per expert (what transformers' `save_pretrained` writes, and the published
Qwen3-MoE files): `mlp.experts.{e}.{gate,up,down}_proj.weight`, [I, H] and [H, I], stacked here on a leading
[E] axis. Fused (the published Qwen3.5/3.6-MoE files): `mlp.experts.gate_up_proj` [E, 2I, H], gate rows
first, and `mlp.experts.down_proj` [E, H, I]. A checkpoint's layout is read off its tensor names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from dflash_jax.models.moe_config import MoeSettings
from dflash_jax.weights.mapping import transpose

FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# (HF name under a layer, NNX path below the layer, fix-up, experts stacked from `{expert}` or None)
Tensor = tuple[str, tuple[str, ...], Callable[[np.ndarray], np.ndarray], int | None]


def has_fused_experts(names: Collection[str]) -> bool:
    """Whether a checkpoint with these tensor names stores its experts fused."""
    return any(name.endswith("." + FUSED_GATE_UP) for name in names)


def moe_tensors(moe: MoeSettings, hidden_size: int, fused: bool) -> list[Tensor]:
    """The router, the experts in the given layout and, where the settings have one, the shared expert and
    its gate (kernel [H, 1])."""
    tensors: list[Tensor] = [("mlp.gate.weight", ("mlp", "gate", "kernel"), transpose, None)]
    if fused:
        experts, inner = moe.num_experts, moe.expert_intermediate_size
        gate_up = (experts, 2 * inner, hidden_size)
        tensors += [
            (FUSED_GATE_UP, ("mlp", "experts", "gate_proj"), _fused(gate_up, slice(0, inner)), None),
            (FUSED_GATE_UP, ("mlp", "experts", "up_proj"), _fused(gate_up, slice(inner, None)), None),
            (FUSED_DOWN, ("mlp", "experts", "down_proj"), _fused((experts, hidden_size, inner), slice(None)), None),
        ]
    else:
        tensors += [(f"mlp.experts.{{expert}}.{name}.weight", ("mlp", "experts", name), transpose, moe.num_experts)
                    for name in _PROJECTIONS]
    if moe.has_shared_expert:
        tensors += [(f"mlp.shared_expert.{name}.weight", ("mlp", "shared_expert", name, "kernel"), transpose, None)
                    for name in _PROJECTIONS]
        tensors.append(("mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), transpose, None))
    return tensors


def _fused(shape: tuple[int, ...], rows: slice) -> Callable[[np.ndarray], np.ndarray]:
    """Fix-up of a fused expert tensor [E, out, in]: its rows `rows` of every expert as [E, in, out]. The whole
    tensor's shape is checked here (the loader would otherwise compare, and name, one part's shape)."""
    def fixup(x: np.ndarray) -> np.ndarray:
        if tuple(x.shape) != shape:
            raise ValueError(f"has shape {tuple(x.shape)}, expected {shape} for this config (fused experts)")
        return np.swapaxes(x[:, rows], 1, 2)
    return fixup
