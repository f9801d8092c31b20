"""The ahead-of-time plan (dflash_jax/planning/plan.py): the train step compiled from abstract arrays on simulated CPU
devices, its per-device figures against the shardings and the FLOP model, the budget check, the command, and
(`make test-tpu-plan`, where libtpu installs) deviceless TPU compiles of a 27B-shaped step."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.drafter import Drafter
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.dflash_attention import tile_schedule
from dflash_jax.ops.mask import position_mask
from dflash_jax.planning import compare as plan_compare
from dflash_jax.planning.chips import chip_named, chip_of_kind
from dflash_jax.runtime.errors import UserError
from dflash_jax.planning.collectives import Collective, replica_groups
from dflash_jax.planning.hlo_cost import hlo_cost
from dflash_jax.planning.plan import (Plan, check_budget, format_plan, gpu_cluster, mesh_granules, plan_train_step,
                             slice_topology, target_architecture, topology_devices)
from dflash_jax.planning.compare import Candidate, compare_plans, format_comparison
from dflash_jax.planning.roofline import Roofline, format_run
from dflash_jax.sharding import auto_target_layout, make_mesh
from dflash_jax.train import epochs, validate
from dflash_jax.weights.targets import load_target
from tests.command import dflash_jax, user_error
from tests.planning_fixtures import narrowed, qwen27b_layers
from tests.train_fixtures import make_target, mesh_of, tiny_config, write_corpus


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    return {"target": make_target(root / "qwen3"), "corpus": write_corpus(root / "train.jsonl")}


def counted_step_flops(config, target, drafter, drafter_config) -> float:
    """One step's FLOPs counted from the modules' own kernels and the §5 mask, independently of train/flops.py:
    2 per multiply-add; the frozen target forward once, with the LM head (its tied embedding) on every position
    for the greedy labels; the drafter's trained matmuls 3x (forward, input and weight gradients) and its frozen LM
    head 2x (forward and input gradient)."""
    grid = AnchorGrid(config.data.seq_len, config.data.anchor_stride, config.drafter.block_size)
    rows, queries = grid.seq_len, grid.num_queries
    assert queries >= rows  # so the labels need the head on every position

    def kernels(module) -> dict[str, tuple[int, ...]]:
        return {".".join(map(str, path)): value.shape
                for path, value in nnx.to_flat_state(nnx.state(module, nnx.Param)) if path[-1] == "kernel"}

    target_kernels = kernels(target)
    layers, _, attention_width = target_kernels["layers.self_attn.q_proj.kernel"]  # stacked [L, H, heads x dim]
    vocab, hidden = nnx.state(target, nnx.Param)["embed_tokens"]["embedding"].shape
    target_flops = 2 * rows * sum(np.prod(shape) for shape in target_kernels.values())
    target_flops += 4 * attention_width * layers * rows * (rows + 1) // 2  # QKᵀ and PV on the causal pairs
    target_flops += 2 * rows * vocab * hidden

    drafter_flops = 0
    for name, shape in kernels(drafter).items():
        # fc reads the context; k/v project the context and the block tokens; the rest the block tokens
        tokens = rows if name == "fc.kernel" else queries + rows if name.endswith(("k_proj.kernel", "v_proj.kernel")) \
            else queries
        drafter_flops += 2 * tokens * np.prod(shape)
    for index, layer_type in enumerate(drafter_config.layer_types):
        window = drafter_config.sliding_window if layer_type == "sliding_attention" else None
        width = kernels(drafter)[f"layers.{index}.self_attn.q_proj.kernel"][1]
        drafter_flops += 4 * width * int(position_mask(grid, window).sum())
    head_flops = 2 * queries * vocab * hidden
    return config.data.batch_size * (target_flops + 3 * drafter_flops + 2 * head_flops)

def scored_beyond_the_mask(config, drafter, drafter_config) -> float:
    """FLOPs of the drafter attention's scores that the mask discards: each query chunk scores its key tiles
    (`tile_schedule`) and each row its own block, of which the model counts only the visible positions; forward
    and backward (3x), QK^T and PV."""
    grid = AnchorGrid(config.data.seq_len, config.data.anchor_stride, config.drafter.block_size)
    extra = 0
    for index, layer_type in enumerate(drafter_config.layer_types):
        window = drafter_config.sliding_window if layer_type == "sliding_attention" else None
        width = nnx.state(drafter, nnx.Param)["layers"][index]["self_attn"]["q_proj"]["kernel"].shape[1]
        schedule = tile_schedule(grid, window, config.query_chunk_blocks)
        scored = schedule.pairs * schedule.chunk_rows * schedule.width + grid.num_queries * grid.block_size
        extra += 4 * width * (scored - int(position_mask(grid, window).sum()))
    return config.data.batch_size * 3 * extra


def test_plan_on_simulated_devices_matches_the_shardings_and_the_flop_model(files):
    # LM head chunks that divide their axes (56 drafted slots a row, 640 tokens): no padded work, which the
    # compiler counts and the model does not.
    config = tiny_config(files["target"], files["corpus"], target_layout="fsdp", **{
        "data.batch_size": 8, "mesh.fsdp": 8, "drafter.mask_token_id": 0, "loss.row_chunk": 28,
        "loss.vocab_chunk": 320})
    target_config = target_architecture(config)
    plan = plan_train_step(config, target_config, mesh_of(1, 8, 1), hbm_gib=1.0)
    # The loaded target's weights, split over fsdp = 8: what each device holds is about an eighth (norms and
    # other small vectors that do not divide stay whole).
    target, _ = load_target(config.target_dir, param_dtype=jnp.float32)
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(target)))
    assert whole / 8 <= plan.target_bytes < whole / 4
    assert plan.opt_state_bytes == pytest.approx(2 * plan.params_bytes, rel=0.01)  # AdamW: mu and nu, fp32
    assert plan.batch_bytes == 4 * 4 * config.data.seq_len  # four int32 arrays, one row per device
    parts = plan.target_bytes + plan.params_bytes + plan.opt_state_bytes + plan.batch_bytes + plan.temp_bytes
    assert parts <= plan.total_bytes <= parts + plan.code_bytes + plan.params_bytes + plan.opt_state_bytes + 2**20
    assert plan.rows_per_device == 1 and plan.mesh == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer=None)
    drafter = nnx.eval_shape(lambda: Drafter(drafter_config, rngs=nnx.Rngs(0)))
    # The causal target attention counts its T(T+1)/2 pairs here, T²/2 in the model: 0.1% of this step.
    assert plan.model_flops == pytest.approx(counted_step_flops(config, target, drafter, drafter_config), rel=3e-3)
    # The compiler's matmuls with every loop body times its trip count (the target's layer scan, the label and
    # loss chunks) are the model's count and the scores the mask discards; its own cost analysis, each body
    # once, falls far short.
    counted = plan.model_flops + scored_beyond_the_mask(config, drafter, drafter_config)
    assert plan.cost.flops == pytest.approx(counted / 8, rel=0.03)
    assert plan.xla_flops < 0.8 * plan.model_flops / 8
    assert plan.cost.unknown_loops == 0 and plan.roofline is None  # no peaks for a CPU
    assert plan.largest and plan.largest[0].bytes >= plan.largest[-1].bytes
    check_budget(plan)  # 1 GiB is plenty
    with pytest.raises(UserError, match=r"over the 0\.0 GiB budget; largest arrays: \S+\["):
        check_budget(plan._replace(hbm_bytes=1024))


def test_plan_shows_what_each_target_layout_puts_on_a_device(files):
    """On data=1, fsdp=4, tensor=2: "replicate" holds the whole target per device, "tensor" half of it (the
    norms stay whole), "fsdp" about an eighth. With a budget of 1.5 whole targets, "auto" (the default) settles
    on "tensor": the whole target would take more than the half of a device it may, half of it does not."""
    target, _ = load_target(str(files["target"]), param_dtype=jnp.float32)
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(target)))
    config = tiny_config(files["target"], files["corpus"], target_layout="auto",
                         **{"data.batch_size": 4, "mesh.fsdp": 4, "mesh.tensor": 2, "drafter.mask_token_id": 0})
    plan = plan_train_step(config, target_architecture(config), mesh_of(1, 4, 2), hbm_gib=1.5 * whole / 2**30)
    layouts = plan.target_bytes_by_layout
    assert layouts["replicate"] == whole
    assert whole / 2 <= layouts["tensor"] < 0.55 * whole
    assert whole / 8 <= layouts["fsdp"] < whole / 4
    assert plan.target_layout == "tensor" and plan.target_bytes == layouts["tensor"]
    assert plan.total_bytes >= plan.target_bytes
    assert re.search(r"target weights .*\(tensor layout; fsdp: .*, replicate: ", format_plan(plan))
    # "auto" on the same sizes: replicate where the whole target fits in half a device, fsdp where even half
    # of it does not, and fsdp where the devices report no memory.
    assert auto_target_layout(layouts, 2 * whole) == "replicate"
    assert auto_target_layout(layouts, whole / 2) == "fsdp"
    assert auto_target_layout(layouts, None) == "fsdp"


def test_temporaries_do_not_grow_with_target_depth_and_layers_gather_their_weights(files, tmp_path):
    """The frozen target runs outside the gradient (train/step.py: its outputs are inputs of value_and_grad,
    never part of the differentiated function), so autodiff keeps none of its residuals and the layer scan
    gathers one layer's weights at a time: 4 or 8 target layers, the step's temporaries on fsdp = 8 differ by
    less than one layer's residual stream of a device's rows (each kept layer would add at least that)."""
    temporaries, costs = {}, {}
    for layers in (4, 8):
        target = make_target(tmp_path / f"layers{layers}", num_layers=layers)
        config = tiny_config(target, files["corpus"], **{
            "data.batch_size": 8, "mesh.fsdp": 8, "drafter.mask_token_id": 0, "drafter.target_layer_ids": (1, 3)})
        plan = plan_train_step(config, target_architecture(config), mesh_of(1, 8, 1))
        temporaries[layers], costs[layers] = plan.temp_bytes, plan.cost
    one_residual = 1 * config.data.seq_len * 64 * 4  # a device's row [1, T, H] in fp32
    assert abs(temporaries[8] - temporaries[4]) < one_residual, temporaries
    # Each target layer's fsdp-sharded weights (every matrix and both norms; q/k norms are whole) are
    # all-gathered once as it runs: a device receives (n - 1)/n of them, 7/8 on fsdp = 8, for each of the four
    # extra layers; the embedding, final norm and the drafter's gathers are the same in both.
    c = target_architecture(config)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer_bytes = 4 * (2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
                       + 2 * c.hidden_size)
    gathered = {layers: cost.collective_bytes[Collective("all-gather", ("fsdp",), False)]
                for layers, cost in costs.items()}
    assert gathered[8] - gathered[4] == 4 * layer_bytes * 7 / 8, gathered


def test_a_step_moves_each_weight_about_once(files):
    """fsdp = 8, target and drafter in fp32 (what XLA:CPU moves either way), the loss in 7 row chunks: the
    all-gathers carry each fsdp-sharded weight once, (n - 1)/n of the whole target and drafter, the LM head too
    (one gather for the labels and every loss chunk); all collectives together stay within the bound of one
    gather of every weight and one reduction of the drafter's gradients, 1.25 x (target + 2 x drafter), though
    XLA:CPU all-reduces the gradients whole where TPU and GPU compilers reduce-scatter them."""
    config = tiny_config(files["target"], files["corpus"], target_layout="fsdp", **{
        "data.batch_size": 8, "mesh.fsdp": 8, "drafter.mask_token_id": 0, "loss.row_chunk": 8})
    target_config = target_architecture(config)
    plan = plan_train_step(config, target_config, mesh_of(1, 8, 1))
    target = plan.target_bytes_by_layout["replicate"]
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer=None)
    params = nnx.state(nnx.eval_shape(lambda: Drafter(drafter_config, rngs=nnx.Rngs(0))), nnx.Param)
    drafter = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    moved = plan.cost.collective_bytes
    gathered = moved[Collective("all-gather", ("fsdp",), False)]
    # Measured: 1.169 MB against 7/8 of 1.335 MB; 1.314 MB when the labels and the loss each gathered the head.
    assert gathered <= 1.01 * 7 / 8 * (target + drafter), (gathered, target, drafter)
    assert sum(moved.values()) <= 1.25 * (target + 2 * drafter), (moved, target, drafter)


def test_plan_command_prints_the_plan_and_fails_over_the_budget(files, tmp_path):
    args = ["plan", "--config", "configs/tiny.py", f"--config.target_dir={files['target']}", "--topology", "cpu:4",
            "--mesh", "data=2,fsdp=2,tensor=1"]
    # One compile: the plan is printed and written (--json), then the budget it exceeds stops the command.
    result = dflash_jax(*args, "--hbm_gib", "0.001", "--json", str(tmp_path / "plan.json"), devices=4)
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["mesh"] == {"data": 2, "fsdp": 2, "context": 1, "tensor": 1}
    assert written["prediction"] is None  # no CPU peaks
    assert written["memory_bytes"]["total"] > written["memory_bytes"]["budget"] == int(0.001 * 2**30)
    assert "mesh {'data': 2, 'fsdp': 2, 'context': 1, 'tensor': 1}, 1 rows per (data, fsdp) shard" in result.stdout
    for line in ("target weights", "optimizer state", "temporaries", "generated code", "total", "FLOPs per step"):
        assert line in result.stdout
    message = user_error(result)
    assert "over the 0.0 GiB budget" in message and "largest arrays" in message
    from dflash_jax.commands import plan as plan_command

    with pytest.raises(UserError, match=r"unknown axes \['pipeline'\]"):
        plan_command._mesh_sizes("data=2,fsdp=2,pipeline=4")


@pytest.mark.slow  # compiles a 32K-token row's step (about a minute)
def test_plan_with_a_default_mesh_splits_a_long_row(files, tmp_path):
    """`plan` with no mesh flags settles the mesh as `train` would (design §13.1): one 32K-token row on 8
    devices of a known chip cannot split over (data, fsdp), so the devices go to its tokens (context) and heads
    (tensor), and the plan written is that mesh's (design §19)."""
    result = dflash_jax("plan", "--config", "configs/tiny.py", f"--config.target_dir={files['target']}",
                        "--topology", "gpu:H200x8x1", "--config.data.seq_len=32768", "--config.data.batch_size=1",
                        "--hbm_gib", "80", "--json", str(tmp_path / "plan.json"), devices=8)
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = re.search(r"config.mesh left at its defaults: \w+ layout on data=1,fsdp=1,tensor=(\d),context=(\d),",
                       result.stdout)
    tensor, context = int(chosen.group(1)), int(chosen.group(2))
    assert tensor * context == 8 and context >= 2
    assert json.loads((tmp_path / "plan.json").read_text())["mesh"] == {"data": 1, "fsdp": 1, "context": context,
                                                                        "tensor": tensor}


def test_replica_groups_in_each_of_xla_forms():
    """The device groups of a collective as XLA prints them, against the groups written out by hand."""
    assert replica_groups("replica_groups={{0,2},{1,3}}, dimensions={0}") == [[0, 2], [1, 3]]
    assert replica_groups("replica_groups=[2,4]<=[8], use_global_device_ids=true") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # iota [4,2] over 0..7 laid out [2,2,2] and transposed (1,0,2): 0 1 4 5 2 3 6 7.
    assert replica_groups("replica_groups=[4,2]<=[2,2,2]T(1,0,2)") == [[0, 1], [4, 5], [2, 3], [6, 7]]
    # A 2 x 4 mesh of devices 0..7, grouped along its second axis; then along its first.
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}") == [[0, 4], [1, 5], [2, 6],
                                                                                      [3, 7]]
    # The same mesh holding the devices 0 4 1 5 / 2 6 3 7 ([2,4]T(1,0) read as a list), grouped by columns.
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_0'}, "
                          "dimensions={0}") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    # Sub-axis: of axis_1 (size 4) the part of size 2 with stride 2, i.e. devices 2 apart within a row.
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(2)2}") == [[0, 2], [1, 3], [4, 6],
                                                                                          [5, 7]]
    assert replica_groups("source_target_pairs={{0,1},{1,0}}, channel_id=3") == [[0, 1], [1, 0]]


# A loop of 5 iterations on 8 devices (2 hosts of 4, mesh data=2 x fsdp=4): a [4,8]x[8,16] matmul, an
# all-reduce of 32 bytes across the hosts (groups {i, i+4}) and an all-gather of 32 bytes within them; one
# instruction's metadata holds a line break, as XLA prints op names that contain one.
LOOP_HLO = """HloModule loop, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (state: (s32[], f32[8], f32[4,8], f32[8,16])) -> (s32[], f32[8], f32[4,8], f32[8,16]) {
  %state = (s32[], f32[8]{0}, f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %v = f32[8]{0} get-tuple-element(%state), index=1
  %a = f32[4,8]{1,0} get-tuple-element(%state), index=2
  %b = f32[8,16]{1,0} get-tuple-element(%state), index=3
  %product = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="a
b"}
  %reduced = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %gathered = f32[32]{0} all-gather(%v), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  ROOT %next = (s32[], f32[8]{0}, f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%i, %reduced, %a, %b)
}

%cond (state: (s32[], f32[8], f32[4,8], f32[8,16])) -> pred[] {
  %state = (s32[], f32[8]{0}, f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %five = s32[] constant(5)
  ROOT %less = pred[] compare(%i, %five), direction=LT
}

ENTRY %main (init: (s32[], f32[8], f32[4,8], f32[8,16])) -> (s32[], f32[8], f32[4,8], f32[8,16]) {
  %init = (s32[], f32[8]{0}, f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  ROOT %loop = (s32[], f32[8]{0}, f32[4,8]{1,0}, f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""


def test_hlo_cost_counts_loop_bodies_by_their_trip_count_and_links_by_host():
    cost = hlo_cost(LOOP_HLO, {"data": 2, "fsdp": 4}, lambda device: device // 4)
    assert cost.flops == 5 * 2 * 4 * 16 * 8 and cost.unknown_loops == 0
    # HBM: each iteration's dot (its [4,16] output and both operands), both collectives (output and operand)
    # and the condition's compare (two s32 and a pred); tuples, parameters and constants move nothing.
    assert cost.hbm_bytes == 5 * (4 * (4 * 16 + 4 * 8 + 8 * 16) + 4 * (8 + 8) + 4 * (32 + 8) + (4 + 4 + 1))
    assert cost.collective_bytes == {
        Collective("all-reduce", ("data",), True): 5 * 2 * (2 - 1) / 2 * 32,  # ring: 2 (n - 1)/n x 32 bytes
        Collective("all-gather", ("fsdp",), False): 5 * (4 - 1) * 32}  # (n - 1) x the 32 bytes each holds
    # Without XLA's annotation (TPU programs have none) the trip count is the condition's `index < 5`; with
    # neither, the loop counts once and says so.
    unannotated = LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}', "")
    assert hlo_cost(unannotated, {"data": 2, "fsdp": 4}, lambda device: device // 4) == cost
    # A body that adds 2 to its index (libtpu unrolls its windowed einsum loops twice): `index < 10` is 5 trips.
    stepped = hlo_cost(unannotated.replace("constant(5)", "constant(10)").replace(
        "  ROOT %next = (s32[], f32[8]{0}, f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%i,",
        "  %two = s32[] constant(2)\n  %step = s32[] add(%i, %two)\n"
        "  ROOT %next = (s32[], f32[8]{0}, f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%step,"), {"data": 2, "fsdp": 4},
        lambda device: device // 4)
    assert (stepped.flops, stepped.collective_bytes) == (cost.flops, cost.collective_bytes)
    once = hlo_cost(unannotated.replace("compare(%i, %five)", "compare(%i, %i)"), {"data": 2, "fsdp": 4})
    assert once.flops == cost.flops / 5 and once.unknown_loops == 1
    assert all(not key.remote for key in once.collective_bytes)  # one host by default


# HBM traffic as libtpu's programs move it: a scan's in-place update among a fusion's results (the stacked output
# written one slice a step), a weight's piece prefetched on the chip by an asynchronous slice (S(1): memory-space
# assignment's alternate memory) and a fusion reading that piece there.
TPU_MEMORY_HLO = """HloModule memory, num_partitions=1

%fused_update (p0: bf16[64,128], p1: bf16[1,128], p2: s32[]) -> (bf16[64,128], f32[1,128]) {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[1,128]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %updated = bf16[64,128]{1,0} dynamic-update-slice(%p0, %p1, %p2, %zero)
  %widened = f32[1,128]{1,0} convert(%p1)
  ROOT %out = (bf16[64,128]{1,0}, f32[1,128]{1,0}) tuple(%updated, %widened)
}

%fused_double (q0: f32[256]) -> f32[256] {
  %q0 = f32[256]{0} parameter(0)
  ROOT %twice = f32[256]{0} add(%q0, %q0)
}

ENTRY %main (buffer: bf16[64,128], row: bf16[1,128], index: s32[], weight: s8[4096]) -> ((bf16[64,128], f32[1,128]), f32[256]) {
  %buffer = bf16[64,128]{1,0} parameter(0)
  %row = bf16[1,128]{1,0} parameter(1)
  %index = s32[] parameter(2)
  %weight = s8[4096]{0} parameter(3)
  %update = (bf16[64,128]{1,0}, f32[1,128]{1,0}) fusion(%buffer, %row, %index), kind=kLoop, calls=%fused_update
  %piece-start = ((s8[4096]{0}), s8[1024]{0:S(1)}, s32[]{:S(2)}) slice-start(%weight), slice={[0:1024]}
  %piece = s8[1024]{0:S(1)} slice-done(%piece-start)
  %on-chip = f32[256]{0:S(1)} bitcast(%piece)
  %doubled = f32[256]{0} fusion(%on-chip), kind=kLoop, calls=%fused_double
  ROOT %result = ((bf16[64,128]{1,0}, f32[1,128]{1,0}), f32[256]{0}) tuple(%update, %doubled)
}
"""


def test_hbm_bytes_leave_out_in_place_buffers_and_what_lies_on_the_chip():
    """The update fusion writes its 256-byte row (counted twice, as XLA counts an update) and its f32 row and reads
    the row and the index, not the 16 KiB buffer it updates in place; the asynchronous slice reads its 1 KiB
    piece from HBM into the chip's memory; the second fusion reads that piece there and writes 1 KiB to HBM."""
    cost = hlo_cost(TPU_MEMORY_HLO, {"data": 1})
    assert cost.hbm_bytes == (2 * 256 + 512 + 256 + 4) + 1024 + 1024


# Two dots as libtpu's deviceless compile of the 27B step writes them (shapes and attributes from its HLO): the
# Gated DeltaNet's per-chunk QK^T (einsum bhnid,bhnjd->bhnij over 48 heads x 64 chunks) with its batch dimensions
# as a dilated window, and a projection [4096, 5120] x [5120, 48 x 128] whose head dimension is a padded window.
TPU_DOTS_HLO = """HloModule dots, num_partitions=1

ENTRY %main (q: bf16[48,64,64,128], k: bf16[48,64,64,128], x: bf16[4096,5120,1], w: bf16[48,128,5120]) -> (f32[48,64,64,64], bf16[4096,48,128]) {
  %q = bf16[48,64,64,128]{3,2,1,0} parameter(0)
  %k = bf16[48,64,64,128]{3,2,1,0} parameter(1)
  %x = bf16[4096,5120,1]{1,0,2} parameter(2)
  %w = bf16[48,128,5120]{2,1,0} parameter(3)
  %scores = f32[48,64,64,64]{3,2,1,0} convolution(%q, %k), window={size=48x64 stride=47x63 lhs_dilate=48x64}, dim_labels=01bf_01oi->01bf
  %projected = bf16[4096,48,128]{0,2,1} convolution(%x, %w), window={size=48 pad=47_47 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
  ROOT %out = (f32[48,64,64,64]{3,2,1,0}, bf16[4096,48,128]{0,2,1}) tuple(%scores, %projected)
}
"""


def test_dots_lowered_to_windowed_convolutions_count_only_the_window_positions_that_meet_the_input():
    """Counting every window position would count the first 48 x 64 times and the second 48 times over."""
    cost = hlo_cost(TPU_DOTS_HLO, {"data": 1})
    assert cost.flops == 2 * 48 * 64 * 64 * 64 * 128 + 2 * 4096 * 5120 * 48 * 128


def test_gpu_cluster_topology_puts_data_parallelism_across_hosts():
    """--topology gpu:H200x4x2: 8 simulated devices in 2 hosts of 4; mesh.dcn_data = 2 spans the data axis over
    the hosts, so a mesh row of (fsdp, tensor) devices is one host, and only groups along data leave it."""
    cluster = gpu_cluster("gpu:H200x4x2")
    assert (cluster.chip.name, cluster.per_host, cluster.hosts) == ("H200", 4, 2)
    mesh = make_mesh(data=1, fsdp=2, tensor=2, dcn_data=2, devices=jax.devices("cpu")[:8])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2}
    hosts = np.array(mesh_granules(mesh, cluster.per_host)).reshape(2, 4)
    assert (hosts == [[0] * 4, [1] * 4]).all()
    with pytest.raises(UserError, match=r"expected gpu:<chip>x<GPUs per host>x<hosts>"):
        gpu_cluster("gpu:B300x8")


def test_slice_names_map_to_libtpu_topologies():
    assert slice_topology("v5p-64") == "v5p:2x4x4"  # 32 chips: v5p counts TensorCores
    assert slice_topology("v5p-16") == "v5p:2x2x2"
    assert slice_topology("v5p-8") == "v5p:2x2x1"  # 4 chips: libtpu refuses 1x2x2
    assert slice_topology("v6e-64") == "v6e:8x8"
    assert slice_topology("v5e-8") == "v5e:2x4"
    assert slice_topology("v5p:4x4x4") == "v5p:4x4x4"
    assert slice_topology("tpu7x-64") == "tpu7x:2x4x4"  # TPU7x counts TensorCores too: 32 chips
    assert slice_topology("tpu7x-8") == "tpu7x:2x2x1"
    with pytest.raises(UserError, match="not a power-of-two slice"):
        slice_topology("v6e-48")


def test_the_chip_table_has_the_current_chips_per_device():
    """TPU7x and Blackwell beside the earlier chips: per device (a TPU7x chip is two devices, each with half its
    HBM and peak), each found by its device kind, the GPUs compilable deviceless (their SMs described)."""
    ironwood, v5p = chip_named("tpu7x"), chip_named("v5p")
    assert chip_of_kind("TPU7x") is ironwood and chip_of_kind("TPU v5p") is v5p
    assert ironwood.hbm_bytes == 96 * 2**30 and ironwood.bf16_flops == pytest.approx(1153.5e12)
    assert ironwood.bf16_flops > v5p.bf16_flops and ironwood.hbm_bandwidth > v5p.hbm_bandwidth
    for name, memory in (("B200", 180e9), ("GB200", 186e9), ("B300", 288e9)):
        chip = chip_named(name)
        assert chip_of_kind(f"NVIDIA {name}") is chip and chip.hbm_bytes == memory
        assert chip.bf16_flops > 2 * chip_named("H200").bf16_flops and chip.gpu.compute_capability[0] == 10
        assert chip.source.startswith("https://")
    assert gpu_cluster("gpu:GB200x72x2").chip.name == "GB200"


def _libtpu_or_skip():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install '.[tpu]'); deviceless TPU compiles need it")


@pytest.mark.tpu_plan
def test_deviceless_tpu_temporaries_do_not_grow_with_chips_and_compare_ranks_the_layouts():
    """A 27B-shaped step (one period of 4 target layers with the 27B's attention heads at a narrower width and
    vocabulary, T = 1024, 64 anchors, one row per chip) on v5p slices of 8 and 32 chips: with the activations
    pinned to their rows, a chip's temporaries are its own rows' activations plus one layer's gathered weights,
    whatever the number of chips. On 32 chips
    `plan --compare` (fsdp and tensor layouts, fsdp = 32) ranks both by predicted time per token: the fsdp layout
    all-gathers the target's weights over ICI every step on top of the drafter's, the tensor layout (a whole copy
    per chip at tensor = 1) only the drafter's; nothing crosses DCN on one slice."""
    _libtpu_or_skip()
    config, target_config = narrowed(*qwen27b_layers(4))
    config.drafter.target_layer_ids = (0, 1, 2)
    config.drafter.num_feature_layers = 3
    config.data.seq_len = 1024
    config.target_layout = "fsdp"
    config.mesh.update(data=1, fsdp=8, tensor=1)
    config.data.batch_size = 8
    small = plan_train_step(config, target_config, validate.mesh_from_config(config, topology_devices("v5p-16")))
    config.data.batch_size = 32
    candidates = compare_plans(config, target_config, topology_devices("v5p-64"), 1, ("fsdp", "tensor"), (1,))
    assert [c.mesh for c in candidates] == [dict(data=1, fsdp=32, tensor=1, context=1, dcn_data=1)] * 2
    plans = {c.layout: c.plan for c in candidates}
    assert all(c.plan is not None and not c.reason for c in candidates), [c.reason for c in candidates]
    times = [(t[1] / c.plan.roofline.tokens_per_step, t[0] / c.plan.roofline.tokens_per_step)
             for c in candidates for t in [c.plan.roofline.step_seconds]]
    assert times == sorted(times)  # best first: no-overlap time per token, then overlap
    large = plans["fsdp"]
    for plan in (small, large):
        assert plan.device_kind.startswith("TPU v5") and plan.rows_per_device == 1 and plan.cost.unknown_loops == 0
    assert abs(large.temp_bytes / small.temp_bytes - 1) < 0.10, (small.temp_bytes, large.temp_bytes)
    # The compiled TPU step holds no fp32 copy of the LM head among its largest arrays (the bf16 head's products
    # accumulate in fp32: train/loss.py); tests/train/test_bf16_step.py checks every weight on CPU's lowering.
    head = {(target_config.hidden_size, target_config.vocab_size)}
    head |= {shape[::-1] for shape in head}
    for plan in (small, *plans.values()):
        assert not [a.text for a in plan.largest if a.dtype == "f32" and a.shape in head], plan.largest
    assert large.target_bytes < small.target_bytes / 3  # the weights are split four times finer
    np.testing.assert_allclose(large.model_flops / 32, small.model_flops / 8)
    # Weights reach a chip by all-gathers or by the permute loops of libtpu's windowed einsums (a gather fused
    # into its matmul), whichever the compiler picks.
    gathered = {layout: sum(size for key, size in plan.cost.collective_bytes.items()
                            if key.kind in ("all-gather", "collective-permute") and "fsdp" in key.axes)
                for layout, plan in plans.items()}
    whole = plans["tensor"].target_bytes  # tensor = 1: the whole target on each chip
    # Both layouts gather the FSDP-sharded drafter's weights; the fsdp layout moves the target's on top, once:
    # every weight but the embedding table, which is looked up by rows (models/layers.py), 31/32 of each.
    moved_once = (whole - 2 * target_config.vocab_size * target_config.hidden_size) * 31 / 32
    assert 0.95 * moved_once <= gathered["fsdp"] - gathered["tensor"] <= 1.1 * moved_once, (gathered, whole)
    for plan in plans.values():
        assert plan.roofline.link_bytes["dcn"] == 0 and plan.roofline.link_bytes["ici"] > 0
        # The compiler's count leaves out the splash kernels and adds padded and masked work; the CPU tests hold
        # it to the model within 5%. Counting every window position of TPU's dot-convolutions made it 2.56.
        assert 0.7 < plan.cost.flops / (plan.model_flops / 32) < 1.5 and plan.cost.custom_calls > 0
    table = format_comparison(candidates)
    assert "| fsdp | data=1,fsdp=32,tensor=1,context=1,dcn_data=1 |" in table and "ici " in table and "best: " in table


@pytest.mark.tpu_plan
def test_deviceless_tpu7x_plans_per_device_with_ironwoods_peaks():
    """`--topology tpu7x-8` (4 Ironwood chips, two devices each) compiles a 27B-shaped step (its first 2 target
    layers, narrowed, T = 512) deviceless: 8 devices named TPU7x, each held to half a chip's HBM, and a roofline
    from the chip table's TPU7x peaks."""
    _libtpu_or_skip()
    config, target_config = narrowed(*qwen27b_layers(2))
    config.drafter.target_layer_ids, config.drafter.num_feature_layers = (0, 1), 2
    config.data.seq_len, config.data.batch_size, config.target_layout = 512, 8, "fsdp"
    config.mesh.update(data=1, fsdp=8, tensor=1)
    devices = topology_devices("tpu7x-8")
    assert len(devices) == 8 and devices[0].device_kind == "TPU7x"
    plan = plan_train_step(config, target_config, validate.mesh_from_config(config, devices))
    assert plan.roofline.chip is chip_named("tpu7x") and plan.hbm_bytes == 96 * 2**30
    assert plan.total_bytes < plan.hbm_bytes and plan.backend.startswith("tpu deviceless compiler, 8 x TPU7x")


@pytest.mark.tpu_plan
def test_deviceless_tpu_flops_of_a_35b_a3b_shaped_step_count_the_active_experts():
    """A Qwen3.6-35B-A3B-shaped step (every width of the recipe: 256 experts of 512 with 8 a token and the shared
    expert, V = 248320; one period of 4 target layers, T = 1024, one row per (data, fsdp) shard) on a v5p slice of
    4 chips in the tensor layout on tensor = 2, where the experts are split over tensor (design §13). The model
    count takes only the k routed experts a token reaches (`MoeSettings.active_mlp_params`); the compiler's, read
    from the HLO (the grouped matmuls over each device's experts included), is within 0.7-1.5 of it (measured
    0.95), and no device holds or gathers all 256 experts of a layer."""
    _libtpu_or_skip()
    from configs import qwen36_35b_a3b

    config, full = qwen36_35b_a3b.get_config(), qwen36_35b_a3b.target_config()
    target_config = dataclasses.replace(full, num_hidden_layers=4, layer_types=full.layer_types[:4],
                                        moe=dataclasses.replace(full.moe, sparse_layers=full.moe.sparse_layers[:4]))
    config.drafter.target_layer_ids, config.drafter.num_feature_layers = (0, 1, 2, 3), 4
    config.data.seq_len, config.target_layout = 1024, "tensor"
    config.mesh.update(data=1, fsdp=2, tensor=2)
    config.data.batch_size = 2
    plan = plan_train_step(config, target_config, validate.mesh_from_config(config, topology_devices("v5p-8")))
    assert plan.device_kind.startswith("TPU v5") and plan.cost.unknown_loops == 0
    assert 0.7 < plan.cost.flops / (plan.model_flops / 4) < 1.5
    # A device holds half of every layer's experts (and of the rest), and no array of all 256 of a layer.
    assert plan.target_bytes < 0.55 * plan.target_bytes_by_layout["replicate"]
    assert not [a.text for a in plan.largest if a.shape[-3:] in {(256, 2048, 512), (256, 512, 2048)}]


def test_compare_ranks_by_the_time_a_token_takes_not_the_step():
    """With the batch given per device, 32 (data, fsdp) shards take twice the rows of 16: a step 1.5 times as
    long is the faster run. The roofline figures are the v5p-64 27B comparison's (docs/scaling_and_launching.md,
    step 6)."""
    chip = chip_named("H200")

    def candidate(fsdp: int, tensor: int, seconds: float):
        line = Roofline(chip, {"compute": seconds, "hbm": 0.0, "nvlink": 0.0, "network": 0.0}, {}, 1.0,
                        fsdp * 4096, None)
        plan = Plan(*[None] * len(Plan._fields))._replace(roofline=line, total_bytes=2**30)
        return Candidate("tensor", dict(data=1, fsdp=fsdp, tensor=tensor, dcn_data=1), plan, "")

    rows_16, rows_32 = candidate(16, 2, 0.993), candidate(32, 1, 1.41)
    table = format_comparison(sorted([rows_16, rows_32], key=plan_compare._rank))
    assert table.splitlines()[2].startswith("| tensor | data=1,fsdp=32,tensor=1,dcn_data=1 |")
    assert table.endswith("best: --config.target_layout=tensor --config.mesh.data=1 --config.mesh.fsdp=32 "
                          "--config.mesh.tensor=1 --config.mesh.dcn_data=1")


def test_the_run_time_is_its_steps_or_else_the_time_per_billion_tokens():
    """A run of config.epochs has no length until the corpus is counted: the plan then gives the time per billion
    tokens, and with --epoch_tokens the epochs' steps (train/epochs.py's count)."""
    seconds = {"compute": 2.0, "hbm": 1.0, "nvlink": 0.5, "network": 0.0}  # steps of 2 s - 3.5 s
    line = Roofline(chip_named("H200"), seconds, {"nvlink": 0.0, "network": 0.0}, 1.0, 10**6, None)
    assert format_run(line) == "33.3 min-58.3 min per billion tokens"  # 1000 steps
    steps = epochs.steps_for_epochs(6, 2 * 10**9, 10**6)
    assert format_run(line._replace(steps=steps)) == "12000 steps in 6.7 h-11.7 h"
