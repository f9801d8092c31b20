"""The routed MoE block (models/moe.py) against transformers' Qwen3-MoE and Qwen3.5-MoE sparse blocks (fp32, CPU),
and its routing's tie rule against torch.topk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_jax.models.moe import SparseMoE, grouped_swiglu, route

HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 6, 2


def _torch_block(shared: bool, normalize: bool):
    torch.manual_seed(0)
    if shared:
        from transformers import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
        config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                      num_experts_per_tok=TOP_K, shared_expert_intermediate_size=12)
        block = Qwen3_5MoeSparseMoeBlock(config)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                num_experts_per_tok=TOP_K, norm_topk_prob=normalize)
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    return block.eval()


def _jax_block(block, shared: bool, normalize: bool) -> SparseMoE:
    model = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, normalize, shared_intermediate_size=12 if shared else None,
                      rngs=nnx.Rngs(0))
    t = {name: value.detach().numpy() for name, value in block.state_dict().items()}
    model.gate.kernel[...] = jnp.asarray(t["gate.weight"].T)
    gate_up = t["experts.gate_up_proj"]  # [E, 2I, H], gate rows first
    model.experts.gate_proj[...] = jnp.asarray(gate_up[:, :INTER].transpose(0, 2, 1))
    model.experts.up_proj[...] = jnp.asarray(gate_up[:, INTER:].transpose(0, 2, 1))
    model.experts.down_proj[...] = jnp.asarray(t["experts.down_proj"].transpose(0, 2, 1))
    if shared:
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(model.shared_expert, name).kernel[...] = jnp.asarray(t[f"shared_expert.{name}.weight"].T)
        model.shared_expert_gate.kernel[...] = jnp.asarray(t["shared_expert_gate.weight"].T)
    return model


@pytest.mark.parametrize("shared,normalize", [(False, True), (False, False), (True, True)])
def test_sparse_block_matches_transformers(shared, normalize):
    block = _torch_block(shared, normalize)
    model = _jax_block(block, shared, normalize)
    x = np.random.default_rng(1).standard_normal((2, 7, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()
    got = np.asarray(nnx.jit(lambda m, v: m(v))(model, jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_route_tie_rule():
    # Equal probabilities: jax.lax.top_k takes the lower expert index first. torch.topk on CPU follows no index
    # rule among equal values (it returns e.g. experts 3, 5, 2 for the first row), so with exact ties only the
    # selected weights can agree with transformers; distinct router probabilities pick the same experts.
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                       [0.0, 0.0, 5.0, 0.0, 5.0, 5.0]], np.float32)
    weights, experts = route(jnp.asarray(logits), 3, normalize=False)
    want_w, _ = torch.topk(torch.softmax(torch.from_numpy(logits), -1), 3, dim=-1)
    np.testing.assert_array_equal(np.asarray(experts), [[1, 2, 3], [0, 1, 2], [2, 4, 5]])
    np.testing.assert_allclose(np.asarray(weights), want_w.numpy(), rtol=1e-6)


def test_every_token_reaches_its_experts_when_all_pick_one():
    # No capacity: all tokens routed to the same expert still all get it (a capacity-limited dispatch drops some).
    model = SparseMoE(HIDDEN, INTER, EXPERTS, 1, True, rngs=nnx.Rngs(0))
    model.gate.kernel[...] = jnp.zeros((HIDDEN, EXPERTS)).at[:, 4].set(0.0)  # uniform -> expert 0 by the tie rule
    x = jax.random.normal(jax.random.key(2), (1, 9, HIDDEN))
    got = model(x)
    e = model.experts
    want = (jax.nn.silu(x @ e.gate_proj[0]) * (x @ e.up_proj[0])) @ e.down_proj[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_tiled_dispatch_equals_ragged_dot():
    # Uneven groups, an expert with no rows, and more rows than one tile: both dispatches give the same sums.
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (150, HIDDEN))
    experts = jnp.concatenate([jnp.zeros((100, 1), jnp.int32), jax.random.randint(keys[1], (50, 1), 2, 4)])
    experts = jnp.concatenate([experts, experts + 2], axis=1)  # expert 1 gets no rows
    weights = jax.random.uniform(keys[2], (150, 2))
    gate, up = (jax.random.normal(k, (EXPERTS, HIDDEN, INTER)) for k in keys[3:5])
    down = jax.random.normal(keys[0], (EXPERTS, INTER, HIDDEN))
    tiled = grouped_swiglu(x, experts, weights, gate, up, down, tiled=True)
    ragged = grouped_swiglu(x, experts, weights, gate, up, down, tiled=False)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(ragged), rtol=1e-5, atol=1e-4)


def _dispatch_inputs(rows: int, num_experts: int):
    keys = jax.random.split(jax.random.key(4), 6)
    x = jax.random.normal(keys[0], (rows, 5, HIDDEN))
    weights, experts = route(jax.random.normal(keys[1], (rows, 5, num_experts)), TOP_K, normalize=True)
    gate, up = (jax.random.normal(k, (num_experts, HIDDEN, INTER)) for k in keys[2:4])
    down = jax.random.normal(keys[4], (num_experts, INTER, HIDDEN))
    return x, experts, weights, gate, up, down


@pytest.mark.parametrize("rules, expert_axes, tiled", [
    ({}, ("tensor",), True),  # the table: rows replicated over tensor, one all-reduce adds the shares
    ({}, ("tensor",), False),  # ragged_dot, as off CPU
    ({"expert": "fsdp"}, ("fsdp",), True),  # rows split over the expert axis: gathered, the sums scattered back
    ({"expert": ("fsdp", "tensor")}, ("fsdp", "tensor"), False),
])
def test_expert_parallel_dispatch_equals_one_device(rules, expert_axes, tiled):
    """Experts split over the mesh (design §13): each device computes only its own experts' assignments of the
    rows it holds, and the shares add up to the one-device result; every mesh layout of the table and two
    others the rule table could name."""
    from dflash_jax.models import moe
    from dflash_jax.sharding import LOGICAL_RULES, ROWS_EMBED, logical_spec, make_mesh

    mesh = make_mesh(2, 2, 2)
    x, experts, weights, gate, up, down = _dispatch_inputs(8, 8)
    want = grouped_swiglu(x.reshape(-1, HIDDEN), experts.reshape(-1, TOP_K), weights.reshape(-1, TOP_K), gate, up,
                          down, tiled=tiled).reshape(x.shape)
    table = tuple((name, rules.get(name, axes)) for name, axes in LOGICAL_RULES)

    @jax.jit
    def sharded(x, experts, weights, gate, up, down):
        with nnx.logical_axis_rules(table), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            assert logical_spec(gate.shape, moe.EXPERT_IN, dict(mesh.shape))[0] in (expert_axes, expert_axes[0])
            rows = jax.lax.with_sharding_constraint(x, logical_spec(x.shape, ROWS_EMBED, dict(mesh.shape)))
            return moe.expert_parallel_swiglu(rows, experts, weights, gate, up, down, mesh.abstract_mesh,
                                              expert_axes, tiled=tiled)

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    got = sharded(*jax.device_put((x, experts, weights, gate, up, down), replicated))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
