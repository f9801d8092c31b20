"""Sharding over the (data, fsdp, context, tensor) mesh: a step on any mesh equals one device (rows split over
context included), activations never travel as whole global batches, the logical-axis table's layouts, and
checkpoints move between meshes."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.gated_deltanet import GatedDeltaNet
from dflash_jax.sharding import logical_spec, state_shardings
from dflash_jax.train.checkpoint import Checkpointer
from dflash_jax.train.state import state_spec
from dflash_jax.train.step import put_batch
from tests.train_fixtures import (build, make_qwen3_5_moe_target, make_qwen3_5_target, make_qwen3_moe_target,
                                  make_target, mesh_of, tiny_config, write_corpus)

ROWS = 8  # global batch: one row per device on the 8 simulated devices


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding")
    return {"qwen3": make_target(root / "qwen3"), "qwen3_5": make_qwen3_5_target(root / "qwen3_5"),
            "qwen3_moe": make_qwen3_moe_target(root / "qwen3_moe"),
            # dense MLP layers among sparse ones: two MLP stacks, one run per layer under lax.cond
            "qwen3_moe_mixed": make_qwen3_moe_target(root / "qwen3_moe_mixed", decoder_sparse_step=2),
            "qwen3_5_moe": make_qwen3_5_moe_target(root / "qwen3_5_moe"), "corpus": write_corpus(root / "train.jsonl")}


def config_for(files, kind, data=1, fsdp=1, tensor=1, context=1, target_layout="fsdp", method="dflash"):
    # Qwen3.5-MoE has no dense MLP width for the drafter to copy.
    width = {"drafter.intermediate_size": 96} if kind == "qwen3_5_moe" else {}
    return tiny_config(files[kind], files["corpus"], target_layout=target_layout,
                       **{"data.batch_size": ROWS, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
                          "mesh.context": context, "drafter.method": method, **width})


def one_step(files, kind, mesh_shape, target_layout="fsdp", method="dflash"):
    """Metrics of one step and the parameters it updated, on the host. mesh_shape: (data, fsdp, tensor[, context])."""
    config = config_for(files, kind, *mesh_shape[:3], *mesh_shape[3:], target_layout=target_layout, method=method)
    setup = build(config, mesh_of(*mesh_shape))
    state, metrics = setup.step.train_step(setup.state, setup.target_state, put_batch(next(setup.loader), setup.mesh),
                                           setup.total_steps)
    return jax.device_get(metrics), jax.device_get(state.params), setup.target_state


@pytest.fixture(scope="module")
def one_device(files):
    """kind (and method) -> the one-device step's (metrics, parameters), each computed when a test first asks."""
    steps = {}

    def get(kind, method="dflash"):
        if (kind, method) not in steps:
            steps[kind, method] = one_step(files, kind, (1, 1, 1), method=method)[:2]
        return steps[kind, method]
    return get


def assert_same_step(one_device_step, step):
    (one, single_params), (many, sharded_params) = one_device_step, step
    np.testing.assert_array_equal(many["slot_count"], one["slot_count"])
    np.testing.assert_array_equal(many["slot_correct"], one["slot_correct"])
    np.testing.assert_allclose(many["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose(many["grad_norm"], one["grad_norm"], rtol=1e-4)
    leaves = jax.tree_util.tree_leaves_with_path(single_params)
    for (path, one), many in zip(leaves, jax.tree.leaves(sharded_params)):
        np.testing.assert_allclose(many, one, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


# make test: the data and fsdp axes alone for the dense target (the tensor axis is in test_train_step's (2, 2, 2)
# step; the hybrid target on a mesh in make test is in the layout and context tests below); the rest in make
# test-slow.
@pytest.mark.parametrize("kind, mesh_shape", [
    ("qwen3", (8, 1, 1)), ("qwen3", (1, 8, 1)),
    *[pytest.param(kind, shape, marks=pytest.mark.slow)
      for kind, shape in [("qwen3", (1, 4, 2)), ("qwen3", (2, 2, 2)), ("qwen3_5", (2, 2, 2)), ("qwen3_5", (1, 4, 2)),
                          ("qwen3_5", (8, 1, 1)), ("qwen3_5", (1, 8, 1))]]])
def test_step_on_a_mesh_matches_one_device(files, one_device, kind, mesh_shape):
    assert_same_step(one_device(kind), one_step(files, kind, mesh_shape)[:2])


# Each layout once in make test (the hybrid target in the tensor layout, the dense one replicated), the other two
# in make test-slow.
@pytest.mark.parametrize("kind, target_layout, mesh_shape", [
    ("qwen3_5", "tensor", (1, 4, 2)), ("qwen3", "replicate", (2, 2, 2)),
    pytest.param("qwen3", "tensor", (1, 4, 2), marks=pytest.mark.slow),
    pytest.param("qwen3_5", "replicate", (2, 2, 2), marks=pytest.mark.slow)])
def test_target_layouts_match_one_device(files, one_device, kind, target_layout, mesh_shape):
    """config.target_layout changes where the target's weights lie, never the step's result ("fsdp", the
    default, is the test above)."""
    metrics, params, target_state = one_step(files, kind, mesh_shape, target_layout)
    assert_same_step(one_device(kind), (metrics, params))
    specs = {jax.tree_util.keystr(path): leaf.sharding.spec for path, leaf in
             jax.tree_util.tree_leaves_with_path(target_state)}
    used = {axis for spec in specs.values() for entry in spec if entry
            for axis in ((entry,) if isinstance(entry, str) else entry)}
    # tensor: heads, MLP columns and the vocabulary split over tensor, nothing over fsdp; replicate: nothing split.
    assert used == ({"tensor"} if target_layout == "tensor" else set()), specs


# Mixture-of-experts targets (design §13): experts split over tensor, each device running its own experts' share of
# the rows. In make test the Qwen3-MoE family in the fsdp layout on tensor = 2; the rest in make test-slow
# (tensor = 8 puts one of the 8 experts on each device).
@pytest.mark.parametrize("kind, target_layout, mesh_shape", [
    ("qwen3_moe", "fsdp", (1, 4, 2)),
    *[pytest.param(kind, layout, shape, marks=pytest.mark.slow) for kind, layout, shape in [
        ("qwen3_5_moe", "tensor", (2, 2, 2)),
        ("qwen3_moe", "fsdp", (8, 1, 1)), ("qwen3_moe", "fsdp", (1, 8, 1)), ("qwen3_moe", "fsdp", (2, 2, 2)),
        ("qwen3_moe", "fsdp", (1, 1, 8)), ("qwen3_moe", "tensor", (1, 4, 2)), ("qwen3_moe", "replicate", (2, 2, 2)),
        ("qwen3_5_moe", "fsdp", (1, 4, 2)), ("qwen3_5_moe", "fsdp", (1, 8, 1)), ("qwen3_5_moe", "tensor", (1, 1, 8)),
        ("qwen3_5_moe", "replicate", (2, 2, 2)), ("qwen3_moe_mixed", "fsdp", (1, 4, 2))]]])
def test_moe_step_on_a_mesh_matches_one_device(files, one_device, kind, target_layout, mesh_shape):
    metrics, params, target_state = one_step(files, kind, mesh_shape, target_layout)
    assert_same_step(one_device(kind), (metrics, params))
    specs = {jax.tree_util.keystr(path): leaf.sharding.spec for path, leaf in
             jax.tree_util.tree_leaves_with_path(target_state) if "experts" in jax.tree_util.keystr(path)}
    assert specs
    split = None if target_layout == "replicate" else "tensor"
    for path, spec in specs.items():  # [layers, E, in, out]: the experts split over tensor, each expert whole there
        assert spec[1] == split and "tensor" not in spec[2:], (path, spec)


# One row's tokens over the context axis (design §19), mesh_shape (data, fsdp, tensor, context): in make test the
# hybrid target (the Gated DeltaNet state fold, the convolution's halo, the all-gathered attention) beside fsdp,
# 16 tokens a shard against the drafter's 24-token window; the rest in make test-slow: the dense and MoE targets,
# every context size (8 tokens a shard), mixed with tensor, and the other drafter methods.
@pytest.mark.parametrize("kind, mesh_shape, method", [
    ("qwen3_5", (1, 2, 1, 4), "dflash"),
    *[pytest.param(kind, shape, method, marks=pytest.mark.slow) for kind, shape, method in [
        ("qwen3", (1, 1, 1, 2), "dflash"), ("qwen3", (2, 1, 2, 2), "dflash"), ("qwen3_5", (1, 1, 1, 8), "dflash"),
        ("qwen3_5", (2, 1, 2, 2), "dflash"), ("qwen3_moe", (1, 1, 2, 4), "dflash"),
        ("qwen3_5_moe", (1, 2, 2, 2), "dflash"), ("qwen3_5", (1, 1, 1, 4), "dspark"),
        ("qwen3_5", (1, 1, 1, 4), "dflash2")]]])
def test_rows_split_over_context_match_one_device(files, one_device, kind, mesh_shape, method):
    assert_same_step(one_device(kind, method), one_step(files, kind, mesh_shape, method=method)[:2])


_COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-reduce|reduce-scatter)(-start)?\(")
_ARRAY = re.compile(r"\b(f16|bf16|f32|f64)\[([0-9,]*)\]")


def float_collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(collective, shape) of every floating-point array an all-gather / all-reduce / reduce-scatter yields."""
    found = []
    for match in _COLLECTIVE.finditer(hlo):
        for dtype, dims in _ARRAY.findall(match.group(1)):
            found.append((match.group(2), tuple(int(d) for d in dims.split(",") if d)))
    return found


@pytest.mark.parametrize("kind, mesh_shape, target_layout", [
    ("qwen3", (1, 8, 1), "fsdp"), ("qwen3_5", (1, 4, 2), "fsdp"),
    pytest.param("qwen3_5", (2, 2, 2), "fsdp", marks=pytest.mark.slow),
    ("qwen3_moe", (1, 8, 1), "replicate"),  # experts whole on every device: each dispatches its own rows
    pytest.param("qwen3_5_moe", (1, 4, 2), "fsdp", marks=pytest.mark.slow),
    # rows split over context beside data (design §19): each data group's rows stay its own inside the split
    # attention and the gated delta rule, and the loss's chunks stay on their context shard
    pytest.param("qwen3_5", (2, 2, 1, 2), "fsdp", marks=pytest.mark.slow)])
def test_no_collective_moves_a_global_batch_of_activations(files, kind, mesh_shape, target_layout):
    """Regression test for the activations' sharding constraints: without them the partitioner shards
    activations along the hidden axis (where the FSDP weights are split) and all-reduces or all-gathers
    [global batch, T, ...] arrays onto every device. Weights may be gathered (that is FSDP), activations of
    other devices' rows never. (The embedding lookup gathers the integer token ids of its fsdp group, not
    floats: `models/layers.py`.) mesh_shape: (data, fsdp, tensor[, context])."""
    setup = build(config_for(files, kind, *mesh_shape, target_layout=target_layout), mesh_of(*mesh_shape))
    batch = put_batch(next(setup.loader), setup.mesh)
    hlo = setup.step.train_step.lower(setup.state, setup.target_state, batch, setup.total_steps).compile().as_text()
    collectives = float_collectives(hlo)
    assert any(op == "all-gather" for op, _ in collectives), "expected FSDP weight all-gathers in the step"
    tokens = ROWS * setup.config.data.seq_len  # a mixture of experts' dispatch sees rows as [tokens (x k), H]
    global_batch = [(op, shape) for op, shape in collectives
                    if len(shape) >= 2 and (shape[0] == ROWS or (len(shape) == 2 and shape[0] % tokens == 0))]
    assert not global_batch, f"collectives of global-batch activations: {global_batch}"


def test_gated_deltanet_splits_on_its_heads_without_moving_channels():
    """Tensor parallelism inside a Gated DeltaNet layer (target_layout "tensor", tensor = 2): q, k and v come from
    their own projections and convs, so each device computes its own heads from its own weight columns; the
    layer's only collective is the all-reduce of out_proj's partial sums. (HF's fused q|k|v split in two
    halves gives each device a mix of q, k and v channels, which the partitioner reshuffles with
    collective-permutes of the activations.)"""
    mesh = mesh_of(1, 1, 2)
    layer = GatedDeltaNet(64, num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16,
                          conv_kernel_size=4, rms_norm_eps=1e-6, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    shardings = state_shardings(state, mesh, "tensor")

    def forward(state, x, segment_ids):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nnx.merge(graphdef, state)(x, segment_ids)[0]

    x, segment_ids = jax.numpy.ones((2, 32, 64)), jax.numpy.zeros((2, 32), jax.numpy.int32)
    hlo = jax.jit(forward, in_shardings=(shardings, None, None)).lower(state, x, segment_ids).compile().as_text()
    collectives = re.findall(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                             r"(?:-start)?\(", hlo)
    assert [(shape.split("{")[0], op) for shape, op in collectives] == [("f32[2,32,64]", "all-reduce")], collectives


def test_logical_spec_keeps_only_mesh_axes_that_divide():
    mesh = {"data": 2, "fsdp": 4, "tensor": 2}
    rows_heads = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
    assert logical_spec((16, 64, 8, 128), rows_heads, mesh) == jax.sharding.PartitionSpec(
        ("data", "fsdp"), None, "tensor", None)
    # One row (evaluation) and 3 heads do not split: those dimensions stay whole.
    assert logical_spec((1, 64, 3, 128), rows_heads, mesh) == jax.sharding.PartitionSpec(None, None, None, None)
    # A mesh axis is used once per array, by the first dimension that asks for it.
    assert logical_spec((8, 8), ("activation_heads", "activation_mlp"), mesh) == jax.sharding.PartitionSpec(
        "tensor", None)
    with pytest.raises(ValueError, match="do not match"):
        logical_spec((8, 8), ("activation_batch",), mesh)


def test_a_checkpoint_written_on_one_mesh_restores_on_another(files, tmp_path):
    """Orbax writes each array whole (from its shards) and reads it onto whatever shardings the restore target
    carries: a run saved on fsdp = 8 resumes on (2, 2, 2) with identical values."""
    setup = build(config_for(files, "qwen3_5", 1, 8, 1), mesh_of(1, 8, 1))
    state, _ = setup.step.train_step(setup.state, setup.target_state, put_batch(next(setup.loader), setup.mesh),
                                     setup.total_steps)
    saved = jax.device_get(state)
    writer = Checkpointer(tmp_path, keep=1)
    writer.save(1, state, {"cursor": [3]})
    writer.close()
    other = mesh_of(2, 2, 2)
    spec = state_spec(setup.drafter_config, setup.config, "xla", other)
    restored, data_state = Checkpointer(tmp_path, keep=1).restore(1, spec.abstract)
    assert data_state == {"cursor": [3]}
    for (path, value), expected, sharding in zip(jax.tree_util.tree_leaves_with_path(restored),
                                                 jax.tree.leaves(saved), jax.tree.leaves(spec.shardings)):
        assert value.sharding == sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(value), expected, err_msg=jax.tree_util.keystr(path))
