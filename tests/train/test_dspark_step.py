"""The DSpark training step (design §18) against an independent plain-JAX reference written from speculators'
formulas with full [slots, V] logits and no chunking: the loss and its gradients w.r.t. the Markov weights W1
and W2, the confidence head and a backbone weight; and the `train` command on the toy config trains and resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.drafter import Drafter
from dflash_jax.ops.anchors import DrafterInputs
from dflash_jax.train.step import anchor_grid
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.train.checkpoint import restore_drafter
from dflash_jax.weights.drafter_files import drafter_to_torch_layout, export_drafter, load_drafter_dir
from tests.command import dflash_jax
from tests.train_fixtures import build, make_target, mesh_of, tiny_config, write_corpus

REPO = Path(__file__).resolve().parents[2]
RANK = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_step")
    return make_target(root / "target"), write_corpus(root / "train.jsonl")


def reference_mask(input_ids_shape, loss_mask, segment_ids, anchors, block) -> np.ndarray:
    """Slot k of anchor a predicts position a+k+1: trained iff the anchor and its first label are supervised and
    the label lies in the row, in the anchor's document, and is supervised (loops, not the package's helpers)."""
    rows, length = input_ids_shape
    mask = np.zeros((rows, len(anchors), block), bool)
    for r in range(rows):
        for j, a in enumerate(anchors):
            if not (a + 1 < length and loss_mask[r, a] and loss_mask[r, a + 1]):
                continue
            for k in range(block):
                i = a + k + 1
                mask[r, j, k] = i < length and segment_ids[r, i] == segment_ids[r, a] and bool(loss_mask[r, i])
    return mask


def reference_dpace(ce, mask, alpha):
    """D-PACE per block from its definition: w_j = m_j Σ_{n >= j} m_n Π_{i <= n} s_i, s_i = (1-α)e^{-ce_i}+α
    on trained slots and 1 elsewhere; constants of the loss."""
    ce = jax.lax.stop_gradient(ce)
    s = jnp.where(mask, (1 - alpha) * jnp.exp(-ce) + alpha, 1.0)
    block = ce.shape[-1]
    prefix = jnp.stack([jnp.prod(s[..., :n + 1], axis=-1) for n in range(block)], axis=-1)
    gated = prefix * mask
    return jnp.stack([jnp.sum(gated[..., j:], axis=-1) for j in range(block)], axis=-1) * mask


def reference_loss(params, setup, teacher, batch, mask):
    """Σ m·d·Σ_term w·ℓ / Σ m + α·Σ m·d·BCE(c, sg(Σ_v min(p_v, q_v))) / Σ m on full logits (speculators'
    DSpark loss; d = exp(−k/γ), or D-PACE's weights for the token terms)."""
    config = setup.config
    grid = anchor_grid(config)
    anchors, block = grid.anchors, grid.block_size
    drafter = nnx.merge(setup.spec.graphdef, params)
    hidden, _ = drafter(teacher.features, teacher.block_embeds,
                        DrafterInputs.from_rows(grid, batch["positions"], batch["segment_ids"]))
    rows, length = batch["input_ids"].shape
    hidden = hidden.reshape(rows, len(anchors), block, -1)
    target_out = setup.target(batch["input_ids"], batch["positions"], batch["segment_ids"],
                              setup.drafter_config.target_layer_ids)
    lm_head = setup.target.lm_head_kernel()
    slot_position = np.minimum(anchors[:, None] + np.arange(block)[None, :], length - 1)  # a+k
    target_logits = jnp.einsum("btH,HV->btV", target_out.hidden, lm_head)[:, slot_position]  # p at a+k
    labels = jnp.argmax(target_logits, axis=-1)
    e = drafter.markov_head.w1[...][batch["input_ids"][:, slot_position]]  # W1[x_{a+k}]
    z = jnp.einsum("bnkH,HV->bnkV", hidden, lm_head) + jnp.einsum("bnkr,rV->bnkV", e, drafter.markov_head.w2[...])
    log_q, log_p = jax.nn.log_softmax(z), jax.nn.log_softmax(target_logits)
    q, p = jnp.exp(log_q), jnp.exp(log_p)
    per_term = {"ce": -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0],
                "kl": jnp.sum(p * (log_p - log_q), axis=-1)}
    token = sum(weight * per_term[name] for name, weight in (config.loss.terms or {"ce": 1.0}).items())
    decay = jnp.exp(-jnp.arange(block) / config.loss.gamma)
    weights = reference_dpace(token, mask, config.loss.dpace_alpha) if config.loss.position_weights == "dpace" \
        else decay
    count = jnp.sum(mask)
    loss = jnp.sum(mask * weights * token) / count
    if config.drafter.confidence_alpha > 0:
        accept = jax.lax.stop_gradient(jnp.sum(jnp.minimum(p, q), axis=-1))  # α = Σ min(p, q) = 1 − TV
        head = drafter.confidence_head
        c = jnp.concatenate([hidden, e], axis=-1) @ head.kernel[...][:, 0] + head.bias[...][0]
        bce = -(accept * jax.nn.log_sigmoid(c) + (1 - accept) * jax.nn.log_sigmoid(-c))
        loss = loss + config.drafter.confidence_alpha * jnp.sum(mask * decay * bce) / count
    return loss


@pytest.mark.parametrize("overrides", [
    # the distribution path (KL and CE terms) with the confidence loss, fixed decay
    {"loss.terms": {"ce": 0.5, "kl": 1.0}, "loss.position_weights": "decay"},
    # the hard-CE path without a confidence head, D-PACE weights (slow: a second pair of compiles)
    pytest.param({"loss.position_weights": "dpace", "loss.dpace_alpha": 0.3, "drafter.confidence_alpha": 0.0},
                 marks=pytest.mark.slow),
])
def test_dspark_loss_and_gradients_match_a_dense_reference(files, overrides):
    config = tiny_config(*files, **{"drafter.method": "dspark", "drafter.markov_rank": RANK,
                                    "drafter.confidence_alpha": 0.7, **overrides})
    setup = build(config, mesh_of())
    batch = {key: jnp.asarray(value) for key, value in next(setup.loader).items()}
    params = setup.state.params
    # A Markov bias on the logits' scale, so that it moves the loss (its N(0, 0.01²) init barely does).
    params["markov_head"]["w1"].set_value(params["markov_head"]["w1"][...] * 100)
    teacher = jax.jit(setup.step.teacher)(setup.target_state, batch)
    mask = reference_mask(batch["input_ids"].shape, np.asarray(batch["loss_mask"]),
                          np.asarray(batch["segment_ids"]), anchor_grid(config).anchors, config.drafter.block_size)
    count = jnp.asarray(max(mask.sum(), 1), jnp.float32)
    (loss, aux), grads = jax.jit(jax.value_and_grad(setup.step.drafter_loss, has_aux=True))(
        params, teacher, batch, jax.random.key(0), count)
    expected, expected_grads = jax.jit(jax.value_and_grad(
        lambda params, teacher, batch: reference_loss(params, setup, teacher, batch, jnp.asarray(mask))))(
        params, teacher, batch)

    assert float(count) > 50 and aux.labels.shape[-1] == config.drafter.block_size  # every slot drafted
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5, atol=1e-5)
    checked = [("markov_head", "w1"), ("markov_head", "w2"), ("layers", 0, "mlp", "down_proj", "kernel")]
    if config.drafter.confidence_alpha > 0:
        checked += [("confidence_head", "kernel"), ("confidence_head", "bias")]
        assert float(aux.confidence_loss) > 0
    got, want = dict(nnx.to_flat_state(grads)), dict(nnx.to_flat_state(expected_grads))
    for path in checked:
        g, w = np.asarray(got[path].get_value()), np.asarray(want[path].get_value())
        assert np.abs(w).max() > 0, path
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=str(path))


# slow: two train commands on the toy target, then evaluate --speed and export
@pytest.mark.slow
def test_train_command_trains_and_resumes_dspark_on_the_toy_config(tmp_path):
    workdir = tmp_path / "run"
    args = ["train", "--config", str(REPO / "configs" / "toy.py"), "--workdir", str(workdir),
            "--config.drafter.method=dspark", "--config.data.batch_size=2", "--config.log_every=1",
            "--config.checkpoint_every=1000", "--config.mesh.fsdp=1"]
    for total_steps in (3, 5):
        done = dflash_jax(*args, f"--config.total_steps={total_steps}", timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(record["loss"]) and record["confidence_loss"] > 0 and "acc_0" in record
               for record in steps)
    # The checkpoint holds the heads, trained away from their initialisation.
    drafter, drafter_config, step = restore_drafter(workdir, None)
    assert (step, drafter_config.method, drafter_config.markov_rank) == (5, "dspark", 256)
    fresh = Drafter(drafter_config, rngs=nnx.Rngs(0))
    for head, name in (("markov_head", "w1"), ("markov_head", "w2"), ("confidence_head", "kernel")):
        trained, initial = (np.asarray(getattr(getattr(d, head), name)[...]) for d in (drafter, fresh))
        assert trained.shape == initial.shape and not np.allclose(trained, initial), (head, name)

    # evaluate: exact τ is what the speculative decoder commits, which is plain greedy decoding; no DDTree.
    report = tmp_path / "eval.json"
    done = dflash_jax("evaluate", "--config", str(REPO / "configs" / "toy.py"), "--workdir", str(workdir),
                      "--num_prompts", "4", "--max_new_tokens", "24", "--speed", "--json", str(report), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(report.read_text())
    speed = figures["speed"]
    assert figures["trained"]["tau"] == pytest.approx(speed["tau"], abs=1e-9)
    assert speed["outputs_differing_from_plain"] == 0 and "ddtree" not in speed
    assert figures["trained"]["ddtree_tau"] == {} and len(figures["trained"]["accepted_histogram"]) == 9
    assert "DDTree τ: not defined for this drafter" in done.stdout
    # export: the speculators layout, read back as the same drafter
    done = dflash_jax("export", "--workdir", str(workdir), "--out", str(tmp_path / "export"))
    assert done.returncode == 0, done.stderr[-3000:]
    exported, exported_config = load_drafter_dir(tmp_path / "export")
    assert exported_config == drafter_config
    np.testing.assert_allclose(np.asarray(exported.markov_head.w2[...]), np.asarray(drafter.markov_head.w2[...]),
                               rtol=1e-2, atol=1e-3)  # bf16 on disk

def test_a_dspark_run_starts_from_a_dflash_drafter(files, tmp_path):
    """`drafter.init_from` a DFlash export (design §18): the backbone is the export's, the Markov and confidence
    heads are the run's own initialisation; a DSpark export cannot start a DFlash run (its heads would be lost)."""
    dflash = build(tiny_config(*files), mesh_of())
    source = Drafter(dflash.drafter_config, rngs=nnx.Rngs(7))
    export_drafter(source, dflash.drafter_config, tmp_path / "dflash")
    exported = {name: np.asarray(jnp.asarray(value, jnp.bfloat16), np.float32)  # the export is bf16
                for name, value in drafter_to_torch_layout(source).items()}
    dspark = {"drafter.method": "dspark", "drafter.markov_rank": RANK}
    fresh = build(tiny_config(*files, **dspark), mesh_of())
    warm = build(tiny_config(*files, **dspark, **{"drafter.init_from": str(tmp_path / "dflash")}), mesh_of())
    initial, loaded = (drafter_to_torch_layout(nnx.merge(setup.spec.graphdef, setup.state.params))
                       for setup in (fresh, warm))
    heads = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
             "confidence_head.proj.bias"}
    assert set(loaded) == set(exported) | heads
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, exported[name] if name in exported else initial[name], name)
    assert not np.array_equal(loaded["fc.weight"], initial["fc.weight"])

    export_drafter(nnx.merge(warm.spec.graphdef, warm.state.params), warm.drafter_config, tmp_path / "dspark")
    with pytest.raises(ConfigError, match="a 'dspark' drafter cannot start a 'dflash' run: its "
                                          "confidence_head.proj.bias, .* would be dropped"):
        build(tiny_config(*files, **{"drafter.init_from": str(tmp_path / "dspark")}), mesh_of())
