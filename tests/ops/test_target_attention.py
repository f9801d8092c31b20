"""The targets' full-sequence attention backends against the dense oracle (`grouped_attention` under the whole
[T, T] causal segment mask): the XLA query chunks and splash (Pallas interpreter on CPU), on packed rows with
several documents, GQA and T not a multiple of the chunk or of 128; both targets on either backend; the train
step's teacher and the exact-τ forward on splash over a device mesh."""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.eval.exact_tau import DraftScorer
from dflash_jax.commands.evaluate import placed
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from dflash_jax.models.target import CAUSAL_ATTENTION_IMPLS
from dflash_jax.ops.attention import (causal_attention, causal_attention_fused, causal_segment_mask, cudnn_unsupported,
                                     grouped_attention)
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.ops.splash_attention import causal_attention_splash
from dflash_jax.sharding import make_mesh, replicated
from dflash_jax.train.step import put_batch
from dflash_jax.weights.targets import load_target
from tests.eval_fixtures import VOCAB, drafter_config
from tests.hf_fixtures import QWEN3_5_TEXT_CONFIG, qwen3_config, save_qwen3
from tests.train_fixtures import build, make_target, mesh_of, tiny_config, write_corpus

SEQ_LEN = 300  # not a multiple of the chunks below, nor of the kernel's 128
SCALE = 0.3


def packed_segments(seq_len: int) -> np.ndarray:
    """Row 0: three documents of uneven lengths then padding (segment 0); row 1: a 7-token document then one
    long one."""
    first = [1] * 100 + [2] * 1 + [3] * (seq_len - 131) + [0] * 30
    second = [5] * 7 + [6] * (seq_len - 7)
    return np.asarray([first, second], np.int32)


def qkv(q_heads: int, kv_heads: int, head_dim: int = 16, seed: int = 0, rows: int = 2):
    rng = np.random.default_rng(seed)

    def normal(heads):
        return jnp.asarray(rng.standard_normal((rows, SEQ_LEN, heads, head_dim)), jnp.float32)

    return normal(q_heads), normal(kv_heads), normal(kv_heads)


def dense(q, k, v, segments):
    return grouped_attention(q, k, v, causal_segment_mask(segments, segments), SCALE)


# 16 queries: 19 chunks, past CHUNKS_IN_FLIGHT, so the row walks its chunks' key tiles in loops (and pads to 304).
@pytest.mark.parametrize("query_chunk", [16, 64, 128, 512], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("q_heads, kv_heads", [(6, 2), (4, 1), (2, 2)], ids=["gqa3", "mqa", "mha"])
def test_query_chunks_equal_the_dense_oracle(query_chunk, q_heads, kv_heads):
    q, k, v = qkv(q_heads, kv_heads, seed=q_heads)
    segments = jnp.asarray(packed_segments(SEQ_LEN))
    out = jax.jit(lambda *x: causal_attention(*x, segments, SCALE, query_chunk=query_chunk))(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, dense(q, k, v, segments), atol=1e-5, rtol=0)


def test_query_chunks_score_only_their_causal_prefix():
    """Chunks of 128, 128 and 44 queries score [B, Hkv, chunk, group, keys up to the chunk's end]; no
    [.., T, T] array exists."""
    q, k, v = qkv(4, 2)
    segments = jnp.asarray(packed_segments(SEQ_LEN))
    jaxpr = str(jax.make_jaxpr(lambda *x: causal_attention(*x, segments, SCALE, query_chunk=128))(q, k, v))
    for scores in ("f32[2,2,128,2,128]", "f32[2,2,128,2,256]", "f32[2,2,44,2,300]"):
        assert scores in jaxpr
    assert f"{SEQ_LEN},{SEQ_LEN}]" not in jaxpr


def test_long_rows_score_one_key_tile_at_a_time():
    """Past CHUNKS_IN_FLIGHT chunks, the only scores are one chunk's against one key tile, inside the loops."""
    q, k, v = qkv(4, 2)
    segments = jnp.asarray(packed_segments(SEQ_LEN))
    jaxpr = str(jax.make_jaxpr(lambda *x: causal_attention(*x, segments, SCALE, query_chunk=16))(q, k, v))
    assert "f32[2,2,16,2,16]" in jaxpr and "while" in jaxpr
    assert not re.search(r"f32\[[\d,]*(300|304),[\d,]*\b(300|304)\]", jaxpr)


@pytest.mark.parametrize("q_heads, kv_heads", [(6, 2), (4, 1)], ids=["gqa3", "mqa"])
def test_splash_equals_the_dense_oracle(q_heads, kv_heads):
    q, k, v = qkv(q_heads, kv_heads, seed=10 + q_heads)
    segments = jnp.asarray(packed_segments(SEQ_LEN))
    out = jax.jit(lambda *x: causal_attention_splash(*x, segments, SCALE, interpret=True))(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, dense(q, k, v, segments), atol=1e-5, rtol=0)


def test_splash_bfloat16_inputs():
    q, k, v = qkv(4, 2, seed=3)
    segments = jnp.asarray(packed_segments(SEQ_LEN))
    out = jax.jit(lambda *x: causal_attention_splash(*x, segments, SCALE, interpret=True))(
        *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), dense(q, k, v, segments), atol=3e-2, rtol=0)


@pytest.mark.parametrize("rows", [2, 1], ids=["rows_split", "single_row"])
def test_splash_on_a_mesh_runs_per_shard(rows):
    """Given a mesh the kernel runs per shard: heads split over tensor=2, rows over fsdp=2 when they divide
    evenly; a single row (as in evaluation) goes whole to every shard."""
    q, k, v = qkv(4, 2, seed=4, rows=rows)
    segments = jnp.asarray(packed_segments(SEQ_LEN)[:rows])
    mesh = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    attend = lambda *x: causal_attention_splash(*x, segments, SCALE, mesh=mesh, interpret=True)  # noqa: E731
    out = jax.jit(attend)(q, k, v)
    assert "shard_map" in str(jax.make_jaxpr(attend)(q, k, v))
    np.testing.assert_allclose(out, dense(q, k, v, segments), atol=1e-5, rtol=0)


def model_inputs(vocab_size: int):
    """ids, positions (restarting at 0 in each document) and segments of the packed rows."""
    segments = packed_segments(SEQ_LEN)
    positions = np.zeros_like(segments)
    for row, column in np.argwhere(segments[:, 1:] == segments[:, :-1]):
        positions[row, column + 1] = positions[row, column] + 1  # argwhere is row-major: left to right
    ids = np.random.default_rng(0).integers(0, vocab_size, segments.shape)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.asarray(segments)


def forward(model, inputs):
    """A fresh jit on every call, so that a patched backend is traced anew."""

    @nnx.jit
    def run(model, ids, positions, segments):
        out = model(ids, positions, segments, (0, 1))
        return out.hidden, out.features

    return run(model, *inputs)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_targets_agree_on_every_backend(family, monkeypatch):
    """Same weights on each backend. With the default 512-query chunks the 300-token rows are one chunk, i.e.
    the dense oracle; 128-query chunks, splash and the cuDNN backend's jax.nn call must match it."""
    if family == "qwen3":
        config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=16)
        make = lambda impl: Qwen3(config, rngs=nnx.Rngs(0), attention_impl=impl)  # noqa: E731
    else:
        config = Qwen3_5Config.from_hf({**QWEN3_5_TEXT_CONFIG, "num_hidden_layers": 4})
        make = lambda impl: Qwen3_5(config, rngs=nnx.Rngs(0), attention_impl=impl)  # noqa: E731
    inputs = model_inputs(config.vocab_size)
    dense_out = forward(make("xla"), inputs)
    splash_out = forward(make("splash"), inputs)
    monkeypatch.setitem(CAUSAL_ATTENTION_IMPLS, "xla", functools.partial(causal_attention, query_chunk=128))
    chunked_out = forward(make("xla"), inputs)
    # The cuDNN backend's call, on JAX's reference implementation (there is no GPU here).
    monkeypatch.setitem(CAUSAL_ATTENTION_IMPLS, "cudnn",
                        functools.partial(causal_attention_fused, implementation="xla"))
    fused_out = forward(make("cudnn"), inputs)
    for name, outputs in (("chunks", chunked_out), ("splash", splash_out), ("cudnn call", fused_out)):
        for got, expected in zip(outputs, dense_out):
            np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0, err_msg=name)


def test_exact_tau_scorer_traces_the_target_under_its_mesh(tmp_path, monkeypatch):
    """The exact-τ forward (one row) of a target loaded onto a 4-device mesh: on splash the kernel is given that
    mesh (so it runs per shard, as it must on several chips) and scores as on xla."""
    save_qwen3(tmp_path, qwen3_config(vocab_size=VOCAB), seed=5)
    mesh = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    config = drafter_config()
    drafter = placed(Drafter(config, rngs=nnx.Rngs(0)), config, jnp.float32, replicated(mesh))
    meshes = []

    def recording_splash(*args, mesh):
        meshes.append(mesh)
        return causal_attention_splash(*args, mesh=mesh)

    monkeypatch.setitem(CAUSAL_ATTENTION_IMPLS, "splash", recording_splash)
    text = np.random.default_rng(0).integers(0, VOCAB, 40).astype(np.int32)
    scores = {}
    for impl in ("xla", "splash"):
        target = load_target(tmp_path, param_dtype=jnp.float32, mesh=mesh, attention_impl=impl)[0]
        scores[impl] = DraftScorer(target, drafter, top_k=4)(text)
    assert meshes and all(dict(traced.shape) == dict(mesh.shape) for traced in meshes)
    np.testing.assert_array_equal(scores["splash"][0], scores["xla"][0])  # the target's greedy tokens
    np.testing.assert_array_equal(scores["splash"][1], scores["xla"][1])  # the drafts
    np.testing.assert_allclose(scores["splash"][2], scores["xla"][2], atol=1e-5)


def test_train_step_teacher_follows_config_attention_impl(tmp_path):
    """config.attention_impl reaches the target the train step runs (as `train` loads it): on splash, per
    shard under the step's mesh (rows over fsdp, heads over tensor), the teacher's features and labels are
    those of xla."""
    target_dir, corpus = make_target(tmp_path / "target", num_layers=2), write_corpus(tmp_path / "train.jsonl", 20)
    mesh = mesh_of(1, 2, 2)
    teachers = {}
    for impl in ("xla", "splash"):
        setup = build(tiny_config(target_dir, corpus, attention_impl=impl, **{"drafter.target_layer_ids": (0, 1)}),
                      mesh)
        assert setup.target.layers.self_attn.attention_impl == impl
        with jax.set_mesh(mesh):
            teachers[impl] = jax.jit(setup.step.teacher)(setup.target_state, put_batch(next(setup.loader), mesh))
    np.testing.assert_allclose(teachers["splash"].features, teachers["xla"].features, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(teachers["splash"].labels, teachers["xla"].labels)


@pytest.mark.parametrize("q_heads, kv_heads", [(6, 2), (4, 1), (2, 2)], ids=["gqa3", "mqa", "mha"])
def test_fused_attention_call_equals_the_dense_oracle(q_heads, kv_heads):
    """The cuDNN backend's call (jax.nn.dot_product_attention: causal, the same-segment mask, [B, T, H, D] with
    grouped heads) on JAX's own implementation, which takes the same arguments: masks and layouts are right."""
    q, k, v = qkv(q_heads, kv_heads, seed=20 + q_heads)
    segments = jnp.asarray(packed_segments(SEQ_LEN))
    out = jax.jit(lambda *x: causal_attention_fused(*x, segments, SCALE, implementation="xla"))(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, dense(q, k, v, segments), atol=1e-5, rtol=0)


def test_cudnn_falls_back_to_query_chunks_with_one_log_line(caplog):
    """Off GPU (and for shapes or dtypes cuDNN refuses) the cuDNN backend is the XLA query chunks, said once."""
    q, k, v = qkv(4, 2, seed=5)
    segments = jnp.asarray(packed_segments(SEQ_LEN))
    assert cudnn_unsupported(q, k) == f"no GPU ({jax.devices()[0].platform})"
    with caplog.at_level(logging.WARNING):
        out = causal_attention_fused(q, k, v, segments, SCALE)
    assert [record.getMessage() for record in caplog.records] == [
        "cuDNN attention cannot run here (no GPU (cpu)); the target's attention runs in XLA query chunks"]
    np.testing.assert_array_equal(out, causal_attention(q, k, v, segments, SCALE))
    assert resolve_attention_impl("auto", "gpu") == "cudnn" and resolve_attention_impl("auto", "cpu") == "xla"
