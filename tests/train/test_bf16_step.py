"""The train step in its real dtypes (bf16 target and drafter compute, fp32 drafter masters) on a 2-layer target:
the program copies no target weight to fp32, and its loss and gradients match the fp32 step's.

The program is read as JAX lowers it, before the backend's passes: XLA:CPU has no bf16 dot and upcasts every
bf16 matmul's operands itself (hoisting the converts of a scanned weight stack out of the loop), which TPU and
GPU compilers do not; `make test-tpu-plan` reads the compiled TPU program of the 27B step for the same."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.train.step import put_batch
from tests.train_fixtures import build, make_target, mesh_of, tiny_config, write_corpus

_F32_TENSOR = re.compile(r"tensor<((?:\d+x)+)f32>")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16_step")
    return make_target(root / "target", num_layers=2), write_corpus(root / "train.jsonl")


def loss_and_grads(setup, batch):
    teacher = jax.jit(setup.step.teacher)(setup.target_state, batch)
    grad = jax.jit(jax.value_and_grad(setup.step.drafter_loss, has_aux=True))
    (loss, _), grads = grad(setup.state.params, teacher, batch, jax.random.key(0), jnp.float32(1.0))
    return float(loss), jax.tree.map(lambda g: np.asarray(g, np.float32), grads)


def weight_shapes(state) -> set[tuple[int, ...]]:
    """Every matrix's shape, whole and (a stacked layer's) per layer, in both orientations."""
    shapes = set()
    for x in jax.tree.leaves(state):
        for shape in (tuple(x.shape), tuple(x.shape[1:])) if x.ndim >= 3 else (tuple(x.shape),):
            if len(shape) >= 2:
                shapes |= {shape, shape[::-1]}
    return shapes


def test_bf16_step_holds_no_fp32_copy_of_a_weight_and_matches_fp32(files):
    # The drafter's MLP width (80) differs from the target's (96), so no drafter master shares a target shape.
    overrides = {"drafter.target_layer_ids": (0, 1), "drafter.intermediate_size": 80}
    bf16_dtypes = {"target_dtype": "bfloat16", "compute_dtype": "bfloat16"}
    greedy = build(tiny_config(*files, **bf16_dtypes, **overrides), mesh_of())  # labels: the target's greedy
    batch = put_batch(next(greedy.loader), greedy.mesh)

    target_shapes = weight_shapes(greedy.target_state)
    assert not target_shapes & weight_shapes(greedy.state.params)
    assert {jnp.dtype(x.dtype) for x in jax.tree.leaves(greedy.target_state)} == {jnp.dtype(jnp.bfloat16)}
    program = greedy.step.train_step.lower(greedy.state, greedy.target_state, batch, greedy.total_steps).as_text()
    fp32_shapes = {tuple(int(d) for d in dims.rstrip("x").split("x")) for dims in _F32_TENSOR.findall(program)}
    assert (64, 80) in fp32_shapes  # the drafter's masters and their gradients are fp32: the reading works
    copies = sorted(fp32_shapes & target_shapes)
    assert not copies, f"fp32 arrays of target weights' shapes in the bf16 step: {copies}"

    # Against the fp32 step on the data's labels (a random target's greedy labels flip at its many near-ties
    # between precisions). bf16 tolerance: the target's features and the drafter's products round to 8 mantissa
    # bits; the loss within 1%, each gradient within 5% of its own norm (measured: at most 2%).
    overrides["loss.labels"] = "data"
    loss16, grads16 = loss_and_grads(build(tiny_config(*files, **bf16_dtypes, **overrides), mesh_of()), batch)
    loss32, grads32 = loss_and_grads(build(tiny_config(*files, **overrides), mesh_of()), batch)
    np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
    flat32 = dict(jax.tree_util.tree_flatten_with_path(grads32)[0])
    for path, g16 in jax.tree_util.tree_flatten_with_path(grads16)[0]:
        g32 = flat32[path]
        error = np.linalg.norm(g16 - g32) / max(np.linalg.norm(g32), 1e-12)
        assert error < 0.05, (jax.tree_util.keystr(path), error)
