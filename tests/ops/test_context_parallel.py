"""A row split over a mesh axis equals the row on one device (ops/context_parallel.py, design §19): the gated
delta rule's state fold, the convolution's halo and the all-gathered causal attention, on 2, 4 and 8 simulated
devices, with documents that cross shard boundaries and a row whose last shard is padding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from dflash_jax.models.gated_deltanet import CausalDepthwiseConv
from dflash_jax.models.target import NO_SEGMENT
from dflash_jax.ops.attention import causal_attention
from dflash_jax.ops.context_parallel import (causal_attention_over_context, gated_delta_rule_over_context,
                                             previous_tail)
from dflash_jax.ops.gated_delta import chunked_gated_delta_rule, segment_starts

LENGTH = 128
ROW = PartitionSpec(None, "context")


def _mesh(shards: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:shards]), ("context",))


def _segments(batch: int = 2) -> np.ndarray:
    """Documents of uneven lengths crossing every split of 128 into 2-8 shards; the second row ends in a long
    stretch of padding (its own segment id, as the loader writes it), a whole shard of it at 8 shards."""
    first = np.repeat([0, 1, 2, 3], [37, 50, 9, 32])
    second = np.repeat([5, 6, 7], [70, 33, 25])
    return np.stack([first, second][:batch]).astype(np.int32)


def _delta_inputs(seed: int, heads: int = 3, key_dim: int = 8, value_dim: int = 6):
    keys = jax.random.split(jax.random.key(seed), 5)
    normal = lambda key, *shape: jax.random.normal(key, (2, LENGTH, *shape), jnp.float32)
    q, k = normal(keys[0], heads, key_dim), normal(keys[1], heads, key_dim)
    q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    g = -jax.nn.softplus(normal(keys[3], heads))  # log-decays <= 0
    beta = jax.nn.sigmoid(normal(keys[4], heads))
    return q * key_dim**-0.5, k, normal(keys[2], heads, value_dim), g, beta


# make test: 4 shards of each; make test-slow: the other splits and the state crossing a whole row.
@pytest.mark.parametrize("shards", [4, *[pytest.param(n, marks=pytest.mark.slow) for n in (2, 8)]])
def test_gated_delta_rule_over_shards_equals_one_device(shards):
    q, k, v, g, beta = _delta_inputs(seed=shards)
    segments = jnp.asarray(_segments())
    resets = segment_starts(segments)  # of the whole row: a shard's first token resets where a document starts
    expected, _ = chunked_gated_delta_rule(q, k, v, g, beta, resets, chunk_size=8)

    split = jax.shard_map(functools.partial(gated_delta_rule_over_context, axis="context"), mesh=_mesh(shards),
                          in_specs=ROW, out_specs=ROW)
    out = jax.jit(split)(q, k, v, g, beta, resets)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_gated_delta_rule_state_crosses_every_shard():
    """One document over the whole row: every shard's output depends on all the shards before it (no reset
    anywhere), with decays close to 1 so that the carried state is large."""
    q, k, v, g, beta = _delta_inputs(seed=11)
    g = g * 0.01
    resets = jnp.zeros((2, LENGTH), bool)
    expected, _ = chunked_gated_delta_rule(q, k, v, g, beta, resets)
    alone, _ = chunked_gated_delta_rule(q[:, -16:], k[:, -16:], v[:, -16:], g[:, -16:], beta[:, -16:])
    assert np.abs(np.asarray(alone - expected[:, -16:])).max() > 0.1  # the last shard needs the carried state
    split = jax.shard_map(functools.partial(gated_delta_rule_over_context, axis="context"), mesh=_mesh(8),
                          in_specs=ROW, out_specs=ROW)
    np.testing.assert_allclose(jax.jit(split)(q, k, v, g, beta, resets), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shards", [8, pytest.param(2, marks=pytest.mark.slow)])
def test_convolution_with_the_previous_shards_tail_equals_one_device(shards):
    conv = CausalDepthwiseConv(5, 4, axis="linear_key", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, LENGTH, 5), jnp.float32)
    segments = jnp.asarray(_segments())
    expected = conv(x, segments)

    def per_shard(x, segments):
        history = (previous_tail(x, 3, "context", 0.0), previous_tail(segments, 3, "context", NO_SEGMENT))
        return conv(x, segments, history)

    split = jax.shard_map(per_shard, mesh=_mesh(shards), in_specs=ROW, out_specs=ROW)
    np.testing.assert_allclose(jax.jit(split)(x, segments), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shards, query_chunk", [(4, 8), (2, 12),  # 12: a padded last chunk
                                                  *[pytest.param(n, 8, marks=pytest.mark.slow) for n in (2, 8)]])
def test_causal_attention_over_shards_equals_one_device(shards, query_chunk):
    keys = jax.random.split(jax.random.key(shards), 3)
    q = jax.random.normal(keys[0], (2, LENGTH, 4, 16), jnp.float32)
    k, v = (jax.random.normal(key, (2, LENGTH, 2, 16), jnp.float32) for key in keys[1:])
    segments = jnp.asarray(_segments())
    expected = causal_attention(q, k, v, segments, 0.25)
    split = jax.shard_map(functools.partial(causal_attention_over_context, scale=0.25, axis="context",
                                            query_chunk=query_chunk), mesh=_mesh(shards), in_specs=ROW, out_specs=ROW)
    np.testing.assert_allclose(jax.jit(split)(q, k, v, segments), expected, rtol=1e-5, atol=1e-5)
