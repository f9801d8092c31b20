"""Every candidate mesh and target layout predicted without compiling (design §13.1): memory per device and a
step time from the config's shapes and the chip's peaks, so that `train` compiles only the one it runs and
`plan --compare` only those that could win.

Memory per device: the target's weights in the layout, the drafter's fp32 parameters and Adam state and the
batch are exact (the abstract states' shardings, as plan.py reads them); the temporaries are estimated
(`temporaries`). The step time goes through the same roofline as a compiled step (roofline.py), its amounts
counted from the shapes instead of read from the program: FLOPs are train/flops.py's model count; HBM traffic
reads every weight a device uses once per pass and the optimizer's state twice; collectives (hlo_cost.py's ring
sizes) are the FSDP all-gathers of the target (fsdp layout) and of the drafter (forward and backward) and the
drafter gradients' reduce-scatter over fsdp, the gradients' all-reduce over data, and over tensor an all-reduce
of every layer's attention and MLP output. Rows split over context (design §19) divide every per-token amount by
its size and add the target's K/V all-gathers, the Gated DeltaNet state maps' all-gathers, the drafter's context
K/V gathers and the gradients' all-reduce over context.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from flax import nnx
from ml_collections import ConfigDict

from dflash_jax.ops.attention import QUERY_CHUNK
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.ops.dflash_attention import halo_positions
from dflash_jax.planning.chips import Chip
from dflash_jax.planning.collectives import Collective
from dflash_jax.planning.hlo_cost import HloCost
from dflash_jax.planning.plan import abstract_config, per_device_bytes, target_bytes_by_layout
from dflash_jax.planning.roofline import Roofline, roofline
from dflash_jax.models.moe import EXPERT_IN
from dflash_jax.sharding import AUTO_LAYOUT_ORDER, layout_rules, logical_spec, make_mesh, spec_axes
from dflash_jax.train import flops, validate
from dflash_jax.train.config import anchor_grid
from dflash_jax.train.state import state_spec
from dflash_jax.weights.families import family_of

# plan --compare compiles the candidates whose predicted time per token is within this factor of the best's
# (the analytical amounts leave out padding, masked work and the compiler's fusions: design §13.1).
COMPILE_MARGIN = 1.25
# The fewest tokens a context shard is given by default (`context_sizes_for`): below a few thousand tokens a
# device's share of the work no longer pays for the per-layer gathers (design §19).
MIN_CONTEXT_SHARD = 4096


class Prediction(NamedTuple):
    layout: str
    mesh: dict[str, int]  # data, fsdp, tensor, context within one slice or host, and dcn_data
    config: ConfigDict | None  # the candidate's config (its mesh, layout and batch size); None when it cannot run
    memory: dict[str, float]  # bytes per device: target, params, opt_state, batch, temporaries, total
    roofline: Roofline | None  # None without the chip's peaks, or when it cannot run
    reason: str  # why it cannot run or does not fit; "" when it does
    experts: str = ""  # where a mixture-of-experts target's experts lie (`expert_placement`); "" for a dense one

    @property
    def fits(self) -> bool:
        return self.config is not None and not self.reason


def context_sizes_for(seq_len: int) -> tuple[int, ...]:
    """The context splits worth trying for rows of seq_len tokens: powers of two that divide it and leave each
    shard at least MIN_CONTEXT_SHARD tokens (1 alone for rows of up to 8K tokens)."""
    return tuple(size for size in (1, 2, 4, 8, 16, 32, 64)
                 if size == 1 or (seq_len % size == 0 and seq_len // size >= MIN_CONTEXT_SHARD))


def candidate_meshes(devices: int, granules: int, tensor_sizes: tuple[int, ...],
                     context_sizes: tuple[int, ...] = (1,)) -> list[dict[str, int]]:
    """Within a slice or host, `tensor` x `context` devices and the rest on fsdp; across them the data axis
    (dcn_data)."""
    per_granule = devices // granules
    return [dict(data=1, fsdp=per_granule // (tensor * context), tensor=tensor, context=context, dcn_data=granules)
            for tensor in tensor_sizes for context in context_sizes
            if tensor * context <= per_granule and per_granule % (tensor * context) == 0]


def predict_candidates(config: ConfigDict, target_config, devices: list, granules: int, layouts: tuple[str, ...],
                       tensor_sizes: tuple[int, ...], budget_bytes: float | None, chip: Chip | None,
                       context_sizes: tuple[int, ...] | None = None) -> list[Prediction]:
    """Every candidate predicted, best first (`rank_key`): those that fit, then those that do not.
    context_sizes: the row splits to try (default `context_sizes_for` the row length)."""
    config = abstract_config(config)
    if context_sizes is None:
        context_sizes = context_sizes_for(config.data.seq_len)
    platform = devices[0].platform
    attention_impl = resolve_attention_impl(config.attention_impl, platform)
    first = make_mesh(devices=devices)
    # The abstract states do not depend on the mesh (it only places them): built once, sharded per candidate.
    target_state = nnx.state(family_of(target_config).abstract_model(
        target_config, param_dtype=validate.dtype_of(config.target_dtype), attention_impl=attention_impl,
        mesh=first))
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer=None)
    found = []
    for sizes in candidate_meshes(len(devices), granules, tensor_sizes, context_sizes):
        shards = sizes["data"] * sizes["dcn_data"] * sizes["fsdp"]
        # data.rows_per_device: each candidate's batch is that many rows per (data, fsdp) shard of its own.
        candidate = ConfigDict(config.to_dict())
        candidate.data.batch_size = validate.batch_size(config, shards)
        candidate.mesh.update(sizes)
        micro_batch = candidate.data.batch_size // candidate.grad_accum_steps
        if micro_batch % shards:
            found.extend(Prediction(layout, sizes, None, {}, None, f"{micro_batch} rows per micro-batch do not "
                                    f"split over {shards} (data, fsdp) shards",
                                    expert_placement(target_config, layout, sizes)) for layout in layouts)
            continue
        mesh = make_mesh(**sizes, devices=devices)
        by_layout = target_bytes_by_layout(target_state, mesh)
        spec = state_spec(drafter_config, candidate, attention_impl, mesh)
        params, opt_state = per_device_bytes(spec.abstract.params), per_device_bytes(spec.abstract.opt_state)
        whole = {"target": by_layout["replicate"], "params": sum(x.size * x.dtype.itemsize
                                                                 for x in jax.tree.leaves(spec.abstract.params))}
        for layout in layouts:
            candidate = ConfigDict(candidate.to_dict())
            candidate.target_layout = layout
            rows = micro_batch // shards
            memory = {"target": by_layout[layout], "params": params, "opt_state": opt_state,
                      "batch": 4 * 4 * rows * candidate.grad_accum_steps * candidate.data.seq_len,
                      "temporaries": temporaries(candidate, target_config, drafter_config, rows, sizes, layout,
                                                 whole, params, attention_impl)}
            memory["total"] = sum(memory.values())
            line = None if chip is None else _roofline(candidate, target_config, drafter_config, rows, sizes, layout,
                                                      whole, memory, chip)
            over = budget_bytes is not None and memory["total"] > budget_bytes
            reason = (f"predicted {memory['total'] / 2**30:.1f} GiB of {budget_bytes / 2**30:.1f}" if over else "")
            if layout == "tensor" and sizes["tensor"] == 1 and "replicate" in layouts:
                reason = "the replicate layout's shardings on tensor = 1"  # not compiled twice
            found.append(Prediction(layout, sizes, candidate, memory, line, reason,
                                    expert_placement(target_config, layout, sizes)))
    return sorted(found, key=rank_key)


def expert_placement(target_config, layout: str, sizes: dict[str, int]) -> str:
    """Where a mixture-of-experts target's experts lie on a candidate's mesh in a layout, as the rule table places
    their kernels [E, H, I] (design §13), e.g. "256 over tensor=8 (32 a device), hidden over fsdp=4"; "" for a
    dense target."""
    moe = getattr(target_config, "moe", None)
    if moe is None:
        return ""
    mesh_shape = {"data": sizes["data"] * sizes.get("dcn_data", 1), "fsdp": sizes["fsdp"], "tensor": sizes["tensor"],
                  "context": sizes.get("context", 1)}
    with nnx.logical_axis_rules(layout_rules(layout)):
        spec = logical_spec((moe.num_experts, target_config.hidden_size, moe.expert_intermediate_size), EXPERT_IN,
                            mesh_shape)
    expert_axes, hidden_axes = (tuple(axis for axis in spec_axes(entry) if mesh_shape[axis] > 1)
                                for entry in spec[:2])  # axes that split
    if expert_axes:
        shards = math.prod(mesh_shape[axis] for axis in expert_axes)
        text = (f"{moe.num_experts} over {'x'.join(f'{axis}={mesh_shape[axis]}' for axis in expert_axes)} "
                f"({moe.num_experts // shards} a device)")
    else:
        text = f"{moe.num_experts} on every device"
    if hidden_axes:
        text += ", hidden over " + "x".join(f"{axis}={mesh_shape[axis]}" for axis in hidden_axes)
    return text


def rank_key(prediction: Prediction) -> tuple:
    """Those that fit first, by time per token (roofline.per_token); ties ("replicate" and "tensor" move the same
    bytes on one mesh) to the one with less memory, then to the layout with less weight traffic."""
    line = prediction.roofline
    per_token = line.per_token if line is not None else (math.inf, math.inf)
    return (not prediction.fits, *per_token, prediction.memory.get("total", math.inf),
            AUTO_LAYOUT_ORDER.index(prediction.layout), prediction.mesh["tensor"])


def temporaries(config: ConfigDict, target_config, drafter_config, rows: int, sizes: dict[str, int], layout: str,
                whole: dict[str, int], params: int, attention_impl: str) -> float:
    """An estimate of the step's temporaries per device for `rows` rows of a (data, fsdp) shard: the target's
    kept hidden states (the feature layers and the last, design §13) and one layer's working set, its weights
    gathered whole over fsdp in the fsdp layout; the drafter's weights gathered whole, its gradients, each
    layer's activations on the block tokens (one residual stream a layer under remat) and the context's k/v;
    the LM head's chunk of fp32 logits. Attention scores are materialised only by the "xla" implementation.
    Split over context, a device holds 1/context of the tokens and queries, and its target layer the whole
    row's K/V (gathered), scored by its own queries one [chunk, chunk] tile at a time."""
    tensor, context = sizes["tensor"], sizes.get("context", 1)
    row = config.data.seq_len
    length = row // context  # a device's tokens
    queries = anchor_grid(config).num_queries // context
    target_item = validate.dtype_of(config.target_dtype).dtype.itemsize
    item = validate.dtype_of(config.compute_dtype).dtype.itemsize
    t, d = target_config, drafter_config
    hidden = t.hidden_size
    q_width, kv_width = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    wide = max(2 * t.intermediate_size, q_width + 2 * kv_width) / tensor
    target = rows * length * (hidden * (len(d.target_layer_ids) + 1) + 2 * hidden + wide) * target_item
    if context > 1:  # a split row attends to the gathered row one [chunk, chunk] tile at a time (design §19)
        chunk = min(QUERY_CHUNK, length)
        target += rows * t.num_attention_heads / tensor * chunk * chunk * 4 * 2  # a tile's scores and weights
        target += rows * row * 2 * kv_width / tensor * target_item
    elif attention_impl == "xla":
        target += rows * t.num_attention_heads / tensor * length * row * 4
    if layout == "fsdp":
        target += whole["target"] / (t.num_hidden_layers * tensor)
    moe = getattr(t, "moe", None)
    if moe is not None:  # the dispatch's expert-sorted rows and their SwiGLU: every assignment's (models/moe.py)
        target += rows * length * moe.top_k * 2 * (hidden + moe.expert_intermediate_size) * target_item
    per_layer = hidden if config.remat != "none" else 4 * hidden + 3 * d.intermediate_size / tensor
    drafter = rows * queries * per_layer * d.num_hidden_layers * 4
    drafter += rows * length * (len(d.target_layer_ids) * hidden
                                + 2 * d.num_key_value_heads * d.head_dim * d.num_hidden_layers / tensor) * item
    if attention_impl == "xla":
        drafter += rows * d.num_attention_heads / tensor * queries * (row + d.block_size) * 4
    drafter += whole["params"] / tensor * item / 4 + params  # gathered weights in the compute dtype; gradients
    head = 3 * config.loss.row_chunk * config.loss.vocab_chunk * 4 / tensor
    return target + drafter + head


def _roofline(config: ConfigDict, target_config, drafter_config, rows: int, sizes: dict[str, int], layout: str,
              whole: dict[str, int], memory: dict[str, float], chip: Chip) -> Roofline:
    devices = math.prod(sizes.values())
    fsdp, tensor, data = sizes["fsdp"], sizes["tensor"], sizes["data"] * sizes["dcn_data"]
    context = sizes.get("context", 1)
    item = validate.dtype_of(config.compute_dtype).dtype.itemsize
    target_used = whole["target"] / tensor  # a device's heads and MLP columns, all of them under "replicate"
    drafter_used = whole["params"] / tensor
    hbm = target_used + 3 * drafter_used + 2 * (memory["params"] + memory["opt_state"]) + 2 * memory["temporaries"]
    collectives = {Collective("all-gather", ("fsdp",), False): 2 * (fsdp - 1) * memory["params"],
                   Collective("reduce-scatter", ("fsdp",), False): (fsdp - 1) / fsdp * drafter_used}
    if layout == "fsdp":
        collectives[Collective("all-gather", ("fsdp",), False)] += (fsdp - 1) * memory["target"]
    if data > 1:  # across slices or hosts when dcn_data > 1 (make_mesh)
        collectives[Collective("all-reduce", ("data",), sizes["dcn_data"] > 1)] = \
            2 * (data - 1) / data * memory["params"]
    if context > 1:
        collectives.update(_context_collectives(config, target_config, drafter_config, rows, context, tensor,
                                                memory["params"]))
    if tensor > 1:
        length = config.data.seq_len // context
        queries = anchor_grid(config).num_queries // context
        stream = rows * target_config.hidden_size * item
        outputs = 2 * target_config.num_hidden_layers * length + 3 * 2 * drafter_config.num_hidden_layers * queries
        collectives[Collective("all-reduce", ("tensor",), False)] = 2 * (tensor - 1) / tensor * stream * outputs
    tokens = config.data.batch_size * config.data.seq_len
    cost = HloCost(0.0, hbm, collectives, 0, 0)
    model_flops = flops.train_step_flops(config, target_config, drafter_config)
    return roofline(cost, model_flops / devices, chip, tokens, config.total_steps)


def _context_collectives(config: ConfigDict, target_config, drafter_config, rows: int, context: int, tensor: int,
                         params: float) -> dict[Collective, float]:
    """Bytes a device sends over the context axis a step (all-gathers: (N − 1) x its shard): the target's K/V at
    each full-attention layer, each Gated DeltaNet layer's state map (M, B: [heads, dk, dk + dv] fp32), the
    drafter's context K/V forward and twice backward (rematerialised, and the gradient's way back): gathered
    whole at its full layer, a halo of ⌈(W − 1)/S⌉·S positions by collective permutes at a sliding one (design
    §19), and the gradients' all-reduce."""
    t, d = target_config, drafter_config
    shard = rows * config.data.seq_len // context
    types = getattr(t, "layer_types", None) or ("full_attention",) * t.num_hidden_layers
    full = sum(kind == "full_attention" for kind in types)
    target_item = validate.dtype_of(config.target_dtype).dtype.itemsize
    item = validate.dtype_of(config.compute_dtype).dtype.itemsize
    gather = full * shard * 2 * t.num_key_value_heads * t.head_dim / tensor * target_item
    if full < len(types):
        width = t.linear_key_head_dim * (t.linear_key_head_dim + t.linear_value_head_dim) * 4
        gather += (len(types) - full) * rows * t.linear_num_value_heads / tensor * width
    position = 2 * d.num_key_value_heads * d.head_dim / tensor * item  # a context position's K and V
    stride, prefix = anchor_grid(config).stride, (context - 1) * config.data.seq_len // context
    permute = 0.0
    for layer in range(d.num_hidden_layers):
        halo = halo_positions(d.window(layer), stride, prefix)
        if halo == prefix:
            gather += 3 * shard * position
        else:
            permute += 3 * rows * halo * position
    collectives = {Collective("all-gather", ("context",), False): (context - 1) * gather,
                   Collective("all-reduce", ("context",), False): 2 * (context - 1) / context * params}
    if permute:
        collectives[Collective("collective-permute", ("context",), False)] = permute
    return collectives


def format_choice(chosen: Prediction, predictions: list[Prediction]) -> str:
    """One line: the candidate chosen and why (its prediction, and the next that fits)."""
    fitting = [p for p in predictions if p.fits]
    following = fitting[fitting.index(chosen) + 1:]
    why = f"predicted {chosen.memory['total'] / 2**30:.2f} GiB per device"
    line = chosen.roofline
    if line is not None:
        fastest, slowest = line.step_seconds
        why += f", step {fastest * 1e3:.3g}-{slowest * 1e3:.3g} ms, the least time per token"
        if following and following[0].roofline is not None:
            ratio = following[0].roofline.per_token[0] / line.per_token[0]
            why += f"; next: {following[0].layout} on {mesh_text(following[0].mesh)} at {ratio:.2f}x"
    return (f"{chosen.layout} layout on {mesh_text(chosen.mesh)}, of {len(predictions)} candidates "
            f"({len(predictions) - len(fitting)} predicted not to fit or not to split the rows): {why}")


def mesh_text(sizes: dict[str, int]) -> str:
    return ",".join(f"{axis}={size}" for axis, size in sizes.items())
