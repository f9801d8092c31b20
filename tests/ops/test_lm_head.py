"""The target's greedy labels over vocabulary chunks (ops/lm_head.py, design §6): the plain argmax, ties to the
lowest id, and under a mesh whose tensor axis splits the head, a walk over the chunks that never gathers it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dflash_jax.ops.lm_head import greedy_labels
from dflash_jax.sharding import LM_HEAD, ROWS_EMBED, logical_spec, make_mesh

HIDDEN, VOCAB, CHUNK = 32, 200, 48  # 4 whole chunks and a last one of 8


def inputs():
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(4, 6, HIDDEN)).astype(np.float32)
    kernel = rng.normal(size=(HIDDEN, VOCAB)).astype(np.float32)
    kernel[:, 150] = kernel[:, 7]  # exact ties across chunks: the lower id wins
    kernel[:, 30] *= 3  # the winner of many rows, tied with two ids of later chunks
    kernel[:, 199] = kernel[:, 151] = kernel[:, 30]
    return hidden, kernel


def test_greedy_labels_equal_the_argmax_with_ties_to_the_lowest_id():
    hidden, kernel = inputs()
    expected = np.argmax(hidden @ kernel, axis=-1)
    assert set(np.unique(expected)) & {30, 151, 199} == {30}
    np.testing.assert_array_equal(greedy_labels(jnp.asarray(hidden), jnp.asarray(kernel), CHUNK), expected)


def test_a_head_split_over_tensor_is_never_gathered_whole():
    """The tensor layout's head [H, V] has its vocabulary over tensor: slicing chunks out of it at the loop's
    offset would gather all of it on every trip (the 35B-A3B step's largest collective, 15 GiB a step)."""
    hidden, kernel = inputs()
    kernel = kernel[:, :192]  # the vocabulary divides over tensor = 4
    mesh = make_mesh(data=1, fsdp=2, tensor=4, devices=jax.devices()[:8])
    hidden, kernel = (jax.device_put(x, NamedSharding(mesh, logical_spec(x.shape, axes, dict(mesh.shape))))
                      for x, axes in ((hidden, ROWS_EMBED), (kernel, LM_HEAD)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(greedy_labels, static_argnums=2).lower(hidden, kernel, CHUNK).compile()
    np.testing.assert_array_equal(compiled(hidden, kernel), np.argmax(np.asarray(hidden) @ np.asarray(kernel), -1))
    gathered = re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather", compiled.as_text())
    assert not [shape for shape in gathered if str(HIDDEN) in shape.split(",")], gathered
