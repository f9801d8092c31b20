"""The JAX drafter against the independent PyTorch reference, its config, fc width, init, layout helpers and
rematerialisation policies."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_jax.models.drafter import Drafter, default_target_layer_ids
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.sharding import make_mesh, state_shardings
# zlab_config: the config.json the export writes (design §10)
from dflash_jax.weights.drafter_files import drafter_from_torch_layout, drafter_to_torch_layout, zlab_config
from tests.drafter_fixtures import (BLOCK, FULL, HIDDEN, MASK_ID, SEQ_LEN, SLIDING, VOCAB, _forward, forward,
                                    make_config, packed_rows, random_weights, relative_error)
from tests.torch_reference import ReferenceDrafter, block_ids, reference_logits


# A window of 4 positions scaled 4x: the rows' positions (up to 13 + a block) reach 5x past it.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 8, "beta_slow": 1}
LINEAR = {"rope_type": "linear", "factor": 3.0}


@pytest.mark.parametrize("stride, layer_types, window, rope_scaling", [
    *[(stride, layers, window, None) for stride in (2, 4, 8)  # stride < block, = block, > block
      for layers, window in [((FULL, FULL), None), ((SLIDING, FULL), 5)]],
    (4, (SLIDING, FULL), 5, YARN), (2, (FULL, FULL), None, {**YARN, "mscale": 0.7, "mscale_all_dim": 0.3}),
    (8, (FULL, FULL), None, LINEAR)])
def test_drafter_matches_torch_reference(layer_types, window, stride, rope_scaling):
    config = make_config(layer_types, window, rope_scaling=rope_scaling)
    weights = random_weights(config, seed=stride)
    reference = ReferenceDrafter(zlab_config(config))
    reference.load_state_dict({name: torch.from_numpy(w) for name, w in weights.items()}, strict=True)
    drafter = drafter_from_torch_layout(weights, config, query_chunk_blocks=2)

    features, input_ids, positions, segments = packed_rows(stride, len(config.target_layer_ids))
    rng = np.random.default_rng(0)
    embed_tokens, lm_head = (rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) for _ in range(2))
    grid = AnchorGrid(SEQ_LEN, stride, BLOCK)
    anchors = grid.anchors.tolist()
    with torch.no_grad():
        torch_inputs = [torch.from_numpy(x) for x in (features, input_ids, positions, segments)]
        embeds = torch.from_numpy(embed_tokens)[block_ids(torch_inputs[1], anchors, BLOCK, MASK_ID)]
        expected_hidden = reference(torch_inputs[0], embeds, *torch_inputs[2:], anchors).numpy()
        expected_logits = reference_logits(reference, torch.from_numpy(embed_tokens), torch.from_numpy(lm_head),
                                           *torch_inputs, anchors, MASK_ID).numpy()

    hidden = forward(drafter, jnp.asarray(features), jnp.asarray(embeds.numpy()), jnp.asarray(positions),
                     jnp.asarray(segments), grid)
    assert hidden.shape == (2, grid.num_queries, HIDDEN)
    assert relative_error(hidden, expected_hidden) < 1e-4
    assert relative_error(hidden @ lm_head.T, expected_logits) < 1e-4


def test_torch_layout_round_trip_and_strict_names():
    config = make_config((SLIDING, FULL), 5)
    weights = random_weights(config, seed=0)
    restored = drafter_to_torch_layout(drafter_from_torch_layout(weights, config))
    assert restored.keys() == weights.keys()
    for name, tensor in weights.items():
        np.testing.assert_array_equal(restored[name], tensor, err_msg=name)
    assert restored["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)  # PyTorch [out, in]

    with pytest.raises(ValueError, match=r"missing \['norm.weight'\], unexpected \['lm_head.weight'\]"):
        drafter_from_torch_layout({k: v for k, v in weights.items() if k != "norm.weight"}
                                  | {"lm_head.weight": weights["fc.weight"]}, config)
    bad = dict(weights, **{"layers.1.self_attn.q_proj.weight": weights["layers.1.self_attn.o_proj.weight"][:4]})
    with pytest.raises(ValueError, match=r"layers.1.self_attn.q_proj.weight has shape \(4, 32\), expected \(32, 32\)"):
        drafter_from_torch_layout(bad, config)


def test_fc_reads_all_feature_layers():
    """fc takes n*H inputs (design §12.1): every feature layer's columns change the output; wrong widths fail."""
    config = make_config()
    drafter = Drafter(config, rngs=nnx.Rngs(0))
    n = len(config.target_layer_ids)
    assert drafter.fc.kernel.shape == (n * HIDDEN, HIDDEN)
    features, input_ids, positions, segments = packed_rows(0, n)
    grid = AnchorGrid(SEQ_LEN, 4, BLOCK)
    embeds = jnp.asarray(np.random.default_rng(1).standard_normal((2, grid.num_queries, HIDDEN)), jnp.float32)
    args = (embeds, jnp.asarray(positions), jnp.asarray(segments), grid)
    base = forward(drafter, jnp.asarray(features), *args)
    for layer in range(n):
        changed = features.copy()
        changed[:, :, layer * HIDDEN:(layer + 1) * HIDDEN] += 1.0
        assert not np.allclose(forward(drafter, jnp.asarray(changed), *args), base), f"feature layer {layer}"
    with pytest.raises(ValueError, match=r"context_features has width 64, expected n\*H = 3\*32 = 96"):
        _forward(drafter, jnp.asarray(features[:, :, :64]), *args)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(48, 8) == (1, 7, 14, 20, 26, 32, 39, 45)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(64, 1) == (32,)


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=(FULL,), num_hidden_layers=2), r"layer_types has 1 entries, expected num_hidden_layers = 2"),
    (dict(layer_types=(FULL, "linear_attention")), r"layer_types has unknown types \['linear_attention'\]"),
    (dict(layer_types=(SLIDING, FULL)), r"sliding_window must be a positive int"),
    (dict(block_size=1), r"block_size must be >= 2"),
    (dict(target_layer_ids=(1, 12)), r"target_layer_ids \[1, 12\] has ids \[12\] outside \[0, .* = 11\]"),
    (dict(target_layer_ids=(-1,)), r"target_layer_ids \[-1\] has ids \[-1\]"),
    (dict(target_layer_ids=()), r"target_layer_ids must name at least one"),
    (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of .*num_key_value_heads \(3\)"),
    (dict(mask_token_id=VOCAB), r"mask_token_id \(50\) must lie in \[0, vocab_size = 50\)"),
    (dict(hidden_size=0), r"DrafterConfig.hidden_size must be a positive int"),
    (dict(head_dim=7), r"head_dim must be even"),
    (dict(rope_theta=0.0), r"DrafterConfig.rope_theta must be a positive number"),
])
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_config_from_json_lists_is_hashable():
    config = make_config(layer_types=[SLIDING, FULL], sliding_window=5, target_layer_ids=[1, 5, 9],
                         rope_scaling={"rope_type": "default"})
    assert config.layer_types == (SLIDING, FULL) and config.target_layer_ids == (1, 5, 9)
    assert hash(config) == hash(dataclasses.replace(config))
    assert [config.window(i) for i in range(2)] == [5, None]
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
        Drafter(dataclasses.replace(config, rope_scaling={"rope_type": "dynamic", "factor": 4.0}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        Drafter(config, rngs=nnx.Rngs(0), attention_impl="flash")


def test_init_and_logical_axes():
    drafter = Drafter(make_config((SLIDING, FULL), 5), rngs=nnx.Rngs(0))
    params = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
    for path, param in params:
        value = np.asarray(param.get_value())
        axes = param.get_metadata()["out_sharding"]
        assert len(axes) == value.ndim, path
        if path[-1] == "kernel":
            assert abs(value.std() - 0.02) < 0.003 and abs(value.mean()) < 0.003, path
        else:
            np.testing.assert_array_equal(value, 1.0, err_msg=str(path))
    shardings = nnx.to_flat_state(state_shardings(nnx.state(drafter, nnx.Param), make_mesh()))
    assert len(shardings) == len(params)


def test_bf16_compute_over_fp32_weights_and_gradients():
    config = make_config((SLIDING, FULL), 5)
    weights = random_weights(config, seed=3)
    fp32 = drafter_from_torch_layout(weights, config)
    bf16 = drafter_from_torch_layout(weights, config, dtype=jnp.bfloat16)
    assert all(p.get_value().dtype == jnp.float32 for _, p in nnx.to_flat_state(nnx.state(bf16, nnx.Param)))
    features, _, positions, segments = packed_rows(0, 3)
    grid = AnchorGrid(SEQ_LEN, 4, BLOCK)
    embeds = jnp.asarray(np.random.default_rng(1).standard_normal((2, grid.num_queries, HIDDEN)), jnp.float32)
    args = (jnp.asarray(features), embeds, jnp.asarray(positions), jnp.asarray(segments), grid)
    low = forward(bf16, *args)
    assert low.dtype == jnp.bfloat16
    assert relative_error(low, np.asarray(forward(fp32, *args))) < 5e-2

    def loss(model, features, embeds, positions, segments):
        return jnp.mean(_forward(model, features, embeds, positions, segments, grid).astype(jnp.float32) ** 2)

    grads = nnx.jit(nnx.grad(loss))(bf16, *args[:-1])
    for path, grad in nnx.to_flat_state(grads):
        value = np.asarray(grad.get_value())
        assert value.dtype == np.float32 and np.isfinite(value).all() and np.abs(value).max() > 0, path


def _loss_and_grads(drafter, features, embeds, positions, segments, grid):
    graphdef, params = nnx.split(drafter)

    def loss(params):
        hidden = _forward(nnx.merge(graphdef, params), features, embeds, positions, segments, grid)
        return jnp.mean(jnp.square(hidden))

    return jax.jit(jax.value_and_grad(loss)), params


@pytest.mark.parametrize("policy", ["full", "dots", "attention"])
def test_remat_policies_give_the_same_gradients_with_less_memory(policy):
    """jax.checkpoint per layer changes what the backward recomputes, never the result; "full" keeps only each
    layer's input, so the compiled backward needs less temporary memory than without checkpointing."""
    config = make_config((SLIDING, FULL), 5, intermediate_size=2048)  # MLP activations dominate the memory
    weights = random_weights(config, seed=1)
    features, input_ids, positions, segments = packed_rows(1, len(config.target_layer_ids))
    grid = AnchorGrid(SEQ_LEN, 2, BLOCK)
    embeds = np.random.default_rng(2).standard_normal((2, grid.num_queries, HIDDEN)).astype(np.float32)
    args = tuple(map(jnp.asarray, (features, embeds, positions, segments)))
    results, temp_bytes = {}, {}
    for name in ("none", policy):
        step, params = _loss_and_grads(drafter_from_torch_layout(weights, config, remat=name), *args, grid)
        results[name] = step(params)
        temp_bytes[name] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
    (value, grads), (expected_value, expected_grads) = results[policy], results["none"]
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        assert relative_error(got, np.asarray(expected, np.float64)) < 1e-5  # fp32 rounding of recomputed ops
    if policy == "full":
        assert temp_bytes["full"] < temp_bytes["none"], temp_bytes
    with pytest.raises(ValueError, match="remat must be one of"):
        Drafter(config, rngs=nnx.Rngs(0), remat="everything")
