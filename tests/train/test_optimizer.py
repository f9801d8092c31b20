"""Muon (dflash_jax/train/optimizer.py) against an independent NumPy version of the same algorithm and against
torch.optim.Muon, the optimizer vLLM's speculators trains with; which parameters it takes; its state's sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from dflash_jax.models.layers import param
from dflash_jax.planning.hlo_cost import hlo_cost
from dflash_jax.sharding import make_mesh, state_shardings
from dflash_jax.train.optimizer import matrix_axes, muon

LR, MOMENTUM, DECAY, STEPS = 0.02, 0.95, 0.1, 4


class Weights(nnx.Module):
    """A matrix, a stack of two per-layer matrices, a norm weight and a degenerate [1, N] weight."""

    def __init__(self, rngs: nnx.Rngs):
        normal = jax.random.normal
        self.proj = param(normal(rngs.params(), (6, 10)), ("embed", "mlp"))
        self.stacked = param(normal(rngs.params(), (2, 8, 4)), ("layers", "embed", "q_heads"))
        self.norm = param(1 + 0.1 * normal(rngs.params(), (8,)), ("embed",))
        self.row = param(normal(rngs.params(), (1, 8)), (None, "embed"))


def params_and_grads(steps: int = STEPS):
    params = nnx.state(Weights(nnx.Rngs(0)), nnx.Param)
    keys = jax.random.split(jax.random.key(1), steps)
    grads = [jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params) for k in keys]
    return params, grads


def run_muon(params, grads, ns_dtype, nesterov=True):
    """The weights after len(grads) updates; the non-matrix weights take plain SGD so they are easy to check."""
    tx = muon(optax.constant_schedule(LR), optax.sgd(LR), momentum=MOMENTUM, nesterov=nesterov, weight_decay=DECAY,
              ns_dtype=ns_dtype)
    state = tx.init(params)
    for grad in grads:
        updates, state = jax.jit(tx.update)(grad, state, params)
        params = optax.apply_updates(params, updates)
    return {name: np.asarray(value) for name, value in nnx.to_pure_dict(params).items()}


def numpy_newton_schulz(x: np.ndarray, steps: int = 5) -> np.ndarray:
    """Keller Jordan's quintic Newton-Schulz iteration, float64, on the wide orientation of x."""
    a, b, c = 3.4445, -4.7750, 2.0315
    transposed = x.shape[0] > x.shape[1]
    x = x.T if transposed else x
    x = x / max(np.linalg.norm(x), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def numpy_muon(weight: np.ndarray, grads: list[np.ndarray], nesterov: bool = True) -> np.ndarray:
    """Muon on one matrix: EMA momentum, Nesterov, NS5, update scaled to 0.2*sqrt(max(m, n)), decoupled decay."""
    buffer = np.zeros_like(weight)
    for grad in grads:
        buffer = MOMENTUM * buffer + (1 - MOMENTUM) * grad
        direction = (1 - MOMENTUM) * grad + MOMENTUM * buffer if nesterov else buffer
        weight = weight - LR * (0.2 * np.sqrt(max(weight.shape)) * numpy_newton_schulz(direction) + DECAY * weight)
    return weight


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_numpy_reference(nesterov):
    params, grads = params_and_grads()
    ours = run_muon(params, grads, jnp.float32, nesterov)
    start = {name: np.asarray(value, np.float64) for name, value in nnx.to_pure_dict(params).items()}
    host = [{name: np.asarray(value, np.float64) for name, value in nnx.to_pure_dict(g).items()} for g in grads]

    np.testing.assert_allclose(ours["proj"], numpy_muon(start["proj"], [g["proj"] for g in host], nesterov),
                               rtol=0, atol=2e-5)
    for layer in range(2):  # each layer's matrix is orthogonalised on its own
        expected = numpy_muon(start["stacked"][layer], [g["stacked"][layer] for g in host], nesterov)
        np.testing.assert_allclose(ours["stacked"][layer], expected, rtol=0, atol=2e-5)
    for name in ("norm", "row"):  # not matrices: the other optimizer (SGD here), no decay
        np.testing.assert_allclose(ours[name], start[name] - LR * sum(g[name] for g in host), rtol=0, atol=1e-6)


def test_muon_matches_torch_optim_muon():
    """torch.optim.Muon with adjust_lr_fn="match_rms_adamw" (speculators' --optimizer muon); both orthogonalise in
    bfloat16 but round in different places, so they agree to a few percent of the step (torch alone is 1-2% off
    the exact iteration); PyTorch stores [out, in], the transposed matrix, which gets the transposed update."""
    params, grads = params_and_grads()
    ours = run_muon(params, grads, jnp.bfloat16)
    weight = torch.nn.Parameter(torch.tensor(np.asarray(params["proj"][...]).T.copy()))
    optimizer = torch.optim.Muon([weight], lr=LR, weight_decay=DECAY, momentum=MOMENTUM, nesterov=True,
                                 adjust_lr_fn="match_rms_adamw")
    for grad in grads:
        weight.grad = torch.tensor(np.asarray(grad["proj"][...]).T.copy())
        optimizer.step()
    start = np.asarray(params["proj"][...])
    moved_theirs, moved_ours = weight.detach().numpy().T - start, ours["proj"] - start
    assert np.abs(moved_ours).max() > 0.01  # it moved: each update is 0.02 * (0.2*sqrt(10) * O + 0.1 W)
    np.testing.assert_allclose(moved_ours, moved_theirs, rtol=0, atol=0.05 * np.abs(moved_theirs).max())


def test_which_weights_are_matrices():
    params = nnx.state(Weights(nnx.Rngs(0)), nnx.Param)
    assert matrix_axes(params["proj"]) == (0, 1)
    assert matrix_axes(params["stacked"]) == (1, 2)  # the layers axis is a batch of matrices
    assert matrix_axes(params["norm"]) is None and matrix_axes(params["row"]) is None


def test_muon_state_is_sharded_like_the_parameters():
    params = nnx.state(Weights(nnx.Rngs(0)), nnx.Param)
    state = muon(optax.constant_schedule(LR), optax.adamw(LR)).init(params)
    mesh = make_mesh(2, 2, 2)
    shardings = state_shardings(state, mesh)
    param_specs = state_shardings(params, mesh)
    assert shardings.momentum["proj"].get_value().spec == param_specs["proj"].get_value().spec
    assert shardings.momentum["stacked"].get_value().spec == param_specs["stacked"].get_value().spec
    assert set(nnx.to_pure_dict(state.momentum)) == {"proj", "stacked"}
    placed = jax.device_put(state, shardings)  # every buffer lands on its parameter's layout
    assert placed.momentum["proj"][...].sharding.spec == param_specs["proj"].get_value().spec


class WideWeights(nnx.Module):
    """Two matrices whose long side is the hidden axis (embed) that an fsdp mesh splits, one alone and a stack of
    two layers: the products of Newton-Schulz contract over that side (X X^T) or run on its short one."""

    def __init__(self, rngs: nnx.Rngs):
        self.proj = param(jax.random.normal(rngs.params(), (1536, 512)), ("embed", "mlp"))
        self.stacked = param(jax.random.normal(rngs.params(), (2, 512, 1536)), ("layers", "mlp", "embed"))


def muon_update_on(mesh, params, grads):
    """One Muon update (fp32 Newton-Schulz) compiled for `mesh` with the parameters' layout: its result and the
    matmul FLOPs one device runs."""
    tx = muon(optax.constant_schedule(LR), optax.sgd(LR), ns_dtype=jnp.float32)
    shardings = state_shardings(params, mesh)
    state = jax.device_put(tx.init(params), state_shardings(tx.init(params), mesh))

    def update(grad, state, params):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return tx.update(grad, state, params)[0]

    step = jax.jit(update, in_shardings=(shardings, state_shardings(state, mesh), shardings))
    placed = jax.device_put(params, shardings), jax.device_put(grads, shardings)
    flops = hlo_cost(step.lower(placed[1], state, placed[0]).compile().as_text(), dict(mesh.shape)).flops
    return nnx.to_pure_dict(jax.device_get(step(placed[1], state, placed[0]))), flops


def test_newton_schulz_splits_its_products_over_an_fsdp_mesh():
    """On 8 devices each computes an eighth of the products (left to itself the partitioner computed X X^T's
    square on every device: a quarter each here), with the update one device computes."""
    params = nnx.state(WideWeights(nnx.Rngs(0)), nnx.Param)
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)
    alone, flops_alone = muon_update_on(make_mesh(1, 1, 1, devices=jax.devices()[:1]), params, grads)
    split, flops_split = muon_update_on(make_mesh(1, 8, 1), params, grads)
    for name in alone:
        np.testing.assert_allclose(split[name], alone[name], rtol=1e-4, atol=1e-6)
    assert flops_split == pytest.approx(flops_alone / 8, rel=0.01), (flops_split, flops_alone)
