"""An independent plain-PyTorch DFlash drafter (design §3) and mask (design §5), written from the text of docs/design.md.

It is the numerical reference for the JAX drafter and, later, for exported drafters: its parameter names are
the z-lab export names of design §10 in PyTorch [out, in] layout, so `load_state_dict(strict=True)` checks an
exported state dict name by name and shape by shape. The mask is built one (query, key) pair at a time.
The embedding and LM head are the target's, passed in (the drafter has none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn


def reference_mask(segment_ids: Sequence[int], anchors: Sequence[int], block_size: int,
                   window: int | None) -> torch.Tensor:
    """[N*B, T + N*B] bool for one row: queries are block slots, keys are [context | all blocks].

    Query slot k of block j (anchor a): context key p visible iff p < a and segment[p] == segment[a], and on a
    sliding layer (window W) also a + k - W < p; block key (j', k') visible iff j' == j, and on a sliding
    layer also k' <= k.
    """
    rows = []
    for j, anchor in enumerate(anchors):
        for k in range(block_size):
            row = []
            for p in range(len(segment_ids)):
                visible = p < anchor and segment_ids[p] == segment_ids[anchor]
                if window is not None:
                    visible = visible and p > anchor + k - window
                row.append(visible)
            for other_block in range(len(anchors)):
                for other_slot in range(block_size):
                    visible = other_block == j
                    if window is not None:
                        visible = visible and other_slot <= k
                    row.append(visible)
            rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), normalised in fp32 (Qwen3)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(dim: int, theta: float, scaling: Mapping | None, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2], cos/sin factor) for default, linear or YaRN RoPE.

    YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension", §3.2-3.4, in transformers' form): a
    frequency that turns more than beta_fast times over the original window keeps its value, one that turns
    fewer than beta_slow times is divided by the factor, and the dimensions between blend linearly by index;
    cos and sin are scaled by 0.1 ln(factor) + 1 (or the mscale / mscale_all_dim ratio, or attention_factor).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    assert kind == "yarn", kind
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original

    def index_turning(times: float) -> float:  # the pair index whose frequency turns `times` times over `original`
        # theta^(-2i/D) * original = 2 pi times  <=>  i = D ln(original / (2 pi times)) / (2 ln theta)
        return dim * math.log(original / (2 * math.pi * times)) / (2 * math.log(theta))

    first, last = index_turning(scaling.get("beta_fast") or 32), index_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, dim - 1)
    last = last if last != first else last + 0.001
    interpolated = ((torch.arange(dim // 2, dtype=torch.float32) - first) / (last - first)).clamp(0, 1)
    inv_freq = inv_freq * (1 - interpolated) + (inv_freq / factor) * interpolated

    def magnitude(weight: float) -> float:
        return 1.0 if factor <= 1 else 1.0 + 0.1 * weight * math.log(factor)

    if scaling.get("attention_factor") is not None:
        return inv_freq, scaling["attention_factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return inv_freq, magnitude(scaling["mscale"]) / magnitude(scaling["mscale_all_dim"])
    return inv_freq, magnitude(1.0)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, scaling: Mapping | None = None,
           max_positions: int = 0) -> torch.Tensor:
    """Neox (rotate-half) RoPE over the full head dim. x: [b, heads, S, D]; positions: [b, S]."""
    dim = x.shape[-1]
    inv_freq, factor = rope_tables(dim, theta, scaling, max_positions)
    angles = positions.float()[..., None] * inv_freq  # [b, S, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [b, 1, S, D]
    first, second = x[..., : dim // 2], x[..., dim // 2:]
    return (x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()) * factor


class Attention(nn.Module):
    def __init__(self, config: Mapping):
        super().__init__()
        hidden, self.head_dim = config["hidden_size"], config["head_dim"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.rope = dict(theta=config["rope_theta"], scaling=config.get("rope_scaling"),
                         max_positions=config["max_position_embeddings"])
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])

    def forward(self, h, ctx, context_positions, block_positions, mask):
        batch, queries, _ = h.shape
        keys = ctx.shape[1] + queries
        q = self.q_norm(self.q_proj(h).view(batch, queries, self.heads, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(h)], dim=1).view(batch, keys, self.kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = torch.cat([self.v_proj(ctx), self.v_proj(h)], dim=1).view(batch, keys, self.kv_heads, self.head_dim)
        v = v.transpose(1, 2)
        q = rotary(q, block_positions, **self.rope)
        k = rotary(k, torch.cat([context_positions, block_positions], dim=1), **self.rope)
        group = self.heads // self.kv_heads  # query head i reads kv head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(batch, queries, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: Mapping):
        super().__init__()
        hidden, inner = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: Mapping):
        super().__init__()
        self.input_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.mlp = MLP(config)

    def forward(self, x, ctx, context_positions, block_positions, mask):
        # ctx goes to the attention as is: it is not passed through input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), ctx, context_positions, block_positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ReferenceDrafter(nn.Module):
    """DFlash drafter from a z-lab style config mapping (the keys of design §10's config.json)."""

    def __init__(self, config: Mapping):
        super().__init__()
        hidden = config["hidden_size"]
        num_features = len(config["dflash_config"]["target_layer_ids"])
        self.block_size = config["block_size"]
        self.windows = [config["sliding_window"] if kind == "sliding_attention" else None
                        for kind in config["layer_types"]]
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config["rms_norm_eps"])
        self.layers = nn.ModuleList(Layer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, config["rms_norm_eps"])

    def forward(self, context_features, block_embeds, positions, segment_ids, anchors: Sequence[int]):
        """Hidden states [b, N*B, H] after the final norm.

        context_features: [b, T, n*H]; block_embeds: [b, N*B, H]; positions, segment_ids: [b, T]; anchors:
        the N anchor positions, shared by every row. Block slot k of anchor a sits at position positions[a]+k.
        """
        offsets = torch.arange(self.block_size)
        block_positions = (positions[:, list(anchors)][:, :, None] + offsets).reshape(positions.shape[0], -1)
        masks = {window: torch.stack([reference_mask(row.tolist(), anchors, self.block_size, window)
                                      for row in segment_ids])
                 for window in set(self.windows)}
        ctx = self.hidden_norm(self.fc(context_features))
        x = block_embeds
        for layer, window in zip(self.layers, self.windows):
            x = layer(x, ctx, positions, block_positions, masks[window])
        return self.norm(x)


def block_ids(input_ids: torch.Tensor, anchors: Sequence[int], block_size: int, mask_token_id: int) -> torch.Tensor:
    """[b, N*B]: each block is the real token at its anchor followed by block_size - 1 mask tokens."""
    blocks = torch.full((input_ids.shape[0], len(anchors), block_size), mask_token_id, dtype=input_ids.dtype)
    blocks[:, :, 0] = input_ids[:, list(anchors)]
    return blocks.reshape(input_ids.shape[0], -1)


def reference_logits(drafter: ReferenceDrafter, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                     context_features, input_ids, positions, segment_ids, anchors: Sequence[int],
                     mask_token_id: int) -> torch.Tensor:
    """[b, N*B, V] drafter logits with the target's embedding [V, H] and lm_head [V, H] weights."""
    embeds = embed_tokens[block_ids(input_ids, anchors, drafter.block_size, mask_token_id)]
    return drafter(context_features, embeds, positions, segment_ids, anchors) @ lm_head.T
