"""DFlash2's training (design §18.4): the fused LM-head loss's candidates and the selector's K-way cross-entropy
against a dense reference on full [rows, V] logits (values and gradients, through the fused pass's custom
gradient), and the `train` command on the toy config trains and resumes a DFlash2 drafter and starts one from a
trained DFlash export. Parity with speculators' own DFlash2 is test_dflash2_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.dflash2 import CandidateSelector, training_candidates
from dflash_jax.models.drafter import Drafter
from dflash_jax.train.divergences import lm_head_divergences
from dflash_jax.train.loss import lm_head_cross_entropy
from dflash_jax.train.selector import selector_cross_entropy
from dflash_jax.train.checkpoint import restore_drafter
from tests.command import dflash_jax
from tests.train_fixtures import make_target, mesh_of, one_step, tiny_config, write_corpus

REPO = Path(__file__).resolve().parents[2]
ROWS, HIDDEN, VOCAB, RANK, TOP_K = 11, 16, 60, 4, 5


def dense_selector_loss(selector, hidden, kernel, labels, predecessors, row_weights):
    """Σ w·(CE of the unary logits + CE over the training candidates) from the full logits."""
    logits = hidden @ kernel
    unary = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)[..., 0]
    ids, _ = training_candidates(jax.lax.stop_gradient(logits), labels, TOP_K)
    scores = selector.scores(hidden, predecessors, ids, jnp.take_along_axis(logits, ids, axis=-1))
    position = jnp.argmax(ids == labels[..., None], axis=-1)
    selector_ce = jax.nn.logsumexp(scores, -1) - jnp.take_along_axis(scores, position[..., None], -1)[..., 0]
    return jnp.sum(row_weights * (unary + 0.7 * selector_ce))


@pytest.mark.parametrize("distribution", [False, True])
def test_selector_loss_through_the_fused_pass_matches_a_dense_reference(distribution):
    rng = np.random.default_rng(int(distribution))
    hidden = jnp.asarray(rng.standard_normal((2, ROWS, HIDDEN)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((HIDDEN, VOCAB)) * 0.5, jnp.float32)
    labels = jnp.asarray(rng.integers(0, VOCAB, (2, ROWS)), jnp.int32)  # random: mostly not among the top-K
    predecessors = jnp.asarray(rng.integers(0, VOCAB, (2, ROWS)), jnp.int32)
    row_weights = jnp.asarray(rng.uniform(size=(2, ROWS)), jnp.float32)
    selector = CandidateSelector(VOCAB, HIDDEN, RANK, TOP_K, rngs=nnx.Rngs(0))
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        codebook.set_value(codebook[...] * 50)  # transitions on the logits' scale
    graphdef, params = nnx.split(selector)

    def fused(params, hidden):
        selector = nnx.merge(graphdef, params)
        if distribution:  # the KL path of the step, against the drafter's own distribution (KL 0: CE alone)
            terms = (("ce", 1.0), ("kl", 1.0))
            kl, _, correct, *candidates = lm_head_divergences(hidden, hidden, kernel, labels, terms, 4, top_k=TOP_K)
            unary = kl
        else:
            unary, correct, *candidates = lm_head_cross_entropy(hidden, kernel, labels, 4, top_k=TOP_K)
        selector_ce, selector_correct = selector_cross_entropy(selector, hidden, kernel, candidates, predecessors,
                                                               labels, 3)
        return jnp.sum(row_weights * (unary + 0.7 * selector_ce)), (candidates, selector_correct)

    def dense(params, hidden):
        return dense_selector_loss(nnx.merge(graphdef, params), hidden, kernel, labels, predecessors, row_weights)

    (value, (candidates, correct)), grads = jax.value_and_grad(fused, argnums=(0, 1), has_aux=True)(params, hidden)
    expected, expected_grads = jax.value_and_grad(dense, argnums=(0, 1))(params, hidden)
    ids, contains = training_candidates(hidden @ kernel, labels, TOP_K)
    np.testing.assert_array_equal(candidates[0], ids)
    np.testing.assert_array_equal(candidates[1], contains)
    assert 0 < int(contains.sum()) < contains.size  # both cases: the label found and the label injected
    assert not np.asarray(correct)[~np.asarray(contains)].any()  # a label decoding would not see is never right
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


# slow: six steps compiled, two on an 8-device mesh (about 40 s on one core)
@pytest.mark.slow
def test_dflash2_step_on_a_mesh_and_in_micro_batches_matches_one_device(tmp_path):
    """The convolutions' and the selector's weights laid out by the rule table (codebooks over the vocabulary on
    `tensor`) and the selector's loss in micro-batches: the same losses and gradient norms as one device."""
    files = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl")
    dflash2 = {"drafter.method": "dflash2", "drafter.conv_group_size": 8, "drafter.selector_rank": 16,
               "drafter.selector_top_k": 8}
    single = one_step(tiny_config(*files, **dflash2), mesh_of())
    sharded = one_step(tiny_config(*files, **dflash2, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),
                       mesh_of(data=2, fsdp=2, tensor=2))
    accumulated = one_step(tiny_config(*files, **dflash2, grad_accum_steps=2), mesh_of())
    for one, *others in zip(single, sharded, accumulated):
        assert one["selector_loss"] > 0
        for other in others:
            np.testing.assert_array_equal(other["slot_correct"], one["slot_correct"])
            np.testing.assert_allclose(other["loss"], one["loss"], rtol=1e-5)
            np.testing.assert_allclose(other["selector_loss"], one["selector_loss"], rtol=1e-5)
            np.testing.assert_allclose(other["grad_norm"], one["grad_norm"], rtol=1e-4)


TOY_ARGS = ["--config", str(REPO / "configs" / "toy.py"), "--config.data.batch_size=2", "--config.log_every=1",
            "--config.checkpoint_every=1000", "--config.mesh.fsdp=1", "--config.eval_every=0"]


# slow: two train commands on the toy target, then a warm start from a DFlash export
@pytest.mark.slow
def test_train_command_trains_resumes_and_warm_starts_dflash2_on_the_toy_config(tmp_path):
    workdir = tmp_path / "run"
    args = ["train", *TOY_ARGS, "--workdir", str(workdir), "--config.drafter.method=dflash2"]
    for total_steps in (3, 5):
        done = dflash_jax(*args, f"--config.total_steps={total_steps}", timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(record["loss"]) and record["selector_loss"] > 0 for record in steps)
    drafter, drafter_config, step = restore_drafter(workdir, None)
    assert (step, drafter_config.method, drafter_config.selector_top_k, drafter_config.conv_kernel_size) == (
        5, "dflash2", 16, 2)
    fresh = Drafter(drafter_config, rngs=nnx.Rngs(0))
    for path in (("candidate_selector", "successor_codebook"), ("layers", 0, "mlp_conv", "base_kernel"),
                 ("layers", 1, "attention_conv", "kernel_projection", "kernel")):
        trained, initial = (np.asarray(dict(nnx.to_flat_state(nnx.state(d, nnx.Param)))[path].get_value())
                            for d in (drafter, fresh))
        assert not np.allclose(trained, initial), path

    # A DFlash2 run started from a trained DFlash drafter's export: its backbone, new parts at initialisation.
    dflash_run, export = tmp_path / "dflash", tmp_path / "dflash_export"
    done = dflash_jax("train", *TOY_ARGS, "--workdir", str(dflash_run), "--config.total_steps=2", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    done = dflash_jax("export", "--workdir", str(dflash_run), "--out", str(export), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    warm = tmp_path / "warm"
    done = dflash_jax("train", *TOY_ARGS, "--workdir", str(warm), "--config.drafter.method=dflash2",
                      f"--config.drafter.init_from={export}", "--config.total_steps=1",
                      "--config.optim.learning_rate=1e-30", "--config.optim.muon_learning_rate=1e-30", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    started = dict(nnx.to_flat_state(nnx.state(restore_drafter(warm, None)[0], nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(restore_drafter(dflash_run, None)[0], nnx.Param)):
        np.testing.assert_allclose(started[path].get_value(), variable.get_value(), rtol=1e-2, atol=1e-2,
                                   err_msg=str(path))  # the export is bf16
    initial = dict(nnx.to_flat_state(nnx.state(fresh, nnx.Param)))  # the run's seed, 0
    for path in (("layers", 0, "attention_conv", "base_kernel"), ("candidate_selector", "predecessor_codebook")):
        np.testing.assert_allclose(started[path].get_value(), initial[path].get_value(), atol=1e-6, err_msg=str(path))
