"""Parity with the installed vLLM speculators 0.9.0 (design §18): on the same weights, rows and anchors, the DSpark
drafter's Markov-corrected logits, its confidence logits, every loss term (ce, kl, rkl, jsd, tv), the confidence
BCE against the detached 1 − TV, the total loss and every weight's gradient equal speculators' PyTorch DSpark
model and eager losses (fp32, CPU), under the fixed decay and D-PACE; and the distribution terms of a plain DFlash
drafter equal its DFlash model's. The reference runs in `.venv-speculators` (tests/train/speculators_reference.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.ops.anchors import DrafterInputs, anchor_validity, slot_mask, slot_tokens
from dflash_jax.sharding import state_shardings
from dflash_jax.train.loss import draft_logits, trained_slot_count
from dflash_jax.train.step import anchor_grid, make_step
from dflash_jax.weights.drafter_files import drafter_to_torch_layout
from tests.train_fixtures import build, make_target, mesh_of, tiny_config, write_corpus

REPO = Path(__file__).resolve().parents[2]
REFERENCE_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
RANK = 8
# The sliding layer's window wider than the rows: at its edge the two differ by design (design §5: context p is
# visible iff a + k − W < p, what vLLM executes; speculators trains with a − W <= p), everything else is compared.
WINDOW = 128
# Our term names and speculators' (its metrics report each term of a multi-term loss as <name>_loss_sum).
SPECULATORS_NAMES = {"ce": "ce", "kl": "kl_div", "rkl": "rkl", "jsd": "jsd", "tv": "tv"}
TERMS = {"ce": 0.3, "kl": 1.0, "rkl": 0.5, "jsd": 0.7, "tv": 0.9}
CASES = [  # (name, our config overrides)
    ("dspark_terms", {"drafter.method": "dspark", "loss.terms": TERMS, "loss.position_weights": "decay",
                      "drafter.confidence_alpha": 0.7}),
    ("dspark_dpace", {"drafter.method": "dspark", "loss.position_weights": "dpace", "drafter.confidence_alpha": 1.0}),
    ("dflash_terms", {"loss.terms": TERMS, "loss.position_weights": "decay"}),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculators_parity")
    return make_target(root / "target"), write_corpus(root / "train.jsonl")


def packed(batch: dict[str, np.ndarray], features, hidden, grid, from_anchor: bool):
    """The rows side by side in one packed row, as speculators trains (documents apart), the valid anchors in it,
    and a loss mask that puts our slot mask at the positions a+k, where speculators reads slot k's."""
    rows, length = batch["input_ids"].shape
    valid = np.asarray(anchor_validity(batch["loss_mask"], grid.anchors))
    slots = np.asarray(slot_mask(batch["loss_mask"], batch["segment_ids"], grid.anchors, grid.block_size,
                                 from_anchor=from_anchor))
    offsets = np.arange(rows)[:, None] * length
    anchors = (offsets + grid.anchors[None, :])[valid]
    loss_mask = np.zeros(rows * length, np.int64)
    loss_mask[anchors[:, None] + np.arange(grid.block_size)[None, :]] = slots[valid]
    segments = np.asarray(batch["segment_ids"]).astype(np.int64)

    def one_row(x):
        x = np.asarray(x)
        return np.ascontiguousarray(x.reshape(1, rows * length, *x.shape[2:]))

    return valid, {"hidden_states": one_row(features).astype(np.float32),
                   "input_ids": one_row(batch["input_ids"]).astype(np.int64), "loss_mask": loss_mask[None],
                   "verifier_last_hidden_states": one_row(hidden).astype(np.float32),
                   "document_ids": one_row(np.where(segments > 0, segments + offsets, -1)),
                   "position_ids": one_row(batch["positions"]).astype(np.int64), "anchors": anchors.astype(np.int64)}


def ours(setup, config, params, batch):
    """Our loss, its confidence part and gradients (torch names) for `config`; the drafter's logits and
    confidence logits at every slot [rows, N, B, V], [rows, N, B]."""
    grid = anchor_grid(config)
    step = make_step(config, setup.drafter_config, setup.spec, nnx.graphdef(setup.target),
                     state_shardings(setup.target_state, setup.mesh, config.target_layout), setup.mesh)
    teacher = jax.jit(step.teacher)(setup.target_state, batch)
    dspark = setup.drafter_config.method == "dspark"
    count = trained_slot_count(slot_mask(batch["loss_mask"], batch["segment_ids"], grid.anchors, grid.block_size,
                                         from_anchor=dspark))
    (loss, aux), grads = jax.jit(jax.value_and_grad(step.drafter_loss, has_aux=True))(
        params, teacher, batch, jax.random.key(0), count)
    drafter = nnx.merge(setup.spec.graphdef, params)
    hidden, _ = drafter(teacher.features, teacher.block_embeds,
                        DrafterInputs.from_rows(grid, batch["positions"], batch["segment_ids"]))
    hidden = hidden.reshape(*teacher.labels.shape[:2], grid.block_size, -1)
    markov = confidence = None
    if dspark:
        e = drafter.markov_head.prev_embeddings(slot_tokens(batch["input_ids"], grid.anchors, grid.block_size))
        markov = (e, drafter.markov_head.w2[...])
        confidence = drafter.confidence_head(hidden, e)
    logits = draft_logits(hidden, teacher.lm_head, markov)
    gradients = drafter_to_torch_layout(nnx.merge(setup.spec.graphdef, grads))
    return float(loss), float(aux.confidence_loss), gradients, np.asarray(logits), confidence, teacher


def run_reference(directory: Path, shape: dict, config, cases: list[dict], arrays: dict[str, np.ndarray]) -> dict:
    """speculators' side (tests/train/speculators_reference.py in .venv-speculators): its out.npz as a dict."""
    (directory / "cases.json").write_text(json.dumps({"shape": shape, "cases": cases, "gamma": config.loss.gamma,
                                                      "dpace_alpha": config.loss.dpace_alpha}))
    np.savez(directory / "arrays.npz", **arrays)
    done = subprocess.run([str(REFERENCE_PYTHON), str(REPO / "tests" / "train" / "speculators_reference.py"),
                           str(directory)], capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(np.load(directory / "out.npz"))


def close(got, want, what: str, tolerance: float = 1e-4) -> None:
    """Within `tolerance` relative to the reference's largest magnitude (fp32 sums in another order)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(float(np.abs(want).max()), 1e-6)
    error = float(np.abs(got - want).max())
    assert error <= tolerance * scale, f"{what}: max |ours - speculators'| = {error:.3g}, scale {scale:.3g}"


@pytest.mark.slow
def test_losses_logits_and_gradients_equal_speculators(files, tmp_path):
    if not REFERENCE_PYTHON.exists():
        pytest.fail(".venv-speculators is missing: `make venv-speculators` builds it")
    setups = {}
    for method in ("dspark", "dflash"):
        setups[method] = build(tiny_config(*files, **{"drafter.method": method, "drafter.markov_rank": RANK,
                                                         "drafter.sliding_window": WINDOW}),
                               mesh_of())
    w1 = setups["dspark"].state.params["markov_head"]["w1"]
    w1.set_value(w1[...] * 100)  # a Markov bias on the logits' scale (its N(0, 0.01²) init barely moves them)
    target = setups["dspark"].target
    batch = {key: jnp.asarray(value) for key, value in next(setups["dspark"].loader).items()}
    grid = anchor_grid(setups["dspark"].config)
    target_hidden = target(batch["input_ids"], batch["positions"], batch["segment_ids"]).hidden
    lm_head = np.asarray(target.lm_head_kernel()).T
    arrays = {"embed": np.asarray(target.embed(jnp.arange(lm_head.shape[0]))), "lm_head": lm_head}
    for method, setup in setups.items():
        arrays.update({f"weight/{method}/{name}": value for name, value in
                       drafter_to_torch_layout(nnx.merge(setup.spec.graphdef, setup.state.params)).items()})

    results, cases, valid = {}, [], {}
    for name, overrides in CASES:
        method = overrides.get("drafter.method", "dflash")
        config = tiny_config(*files, **{"drafter.markov_rank": RANK, "drafter.sliding_window": WINDOW, **overrides})
        results[name] = ours(setups[method], config, setups[method].state.params, batch)
        valid[name], inputs = packed(batch, results[name][-1].features, target_hidden, grid,
                                     from_anchor=method == "dspark")
        arrays.update({f"{name}/{key}": value for key, value in inputs.items()})
        cases.append({"name": name, "method": method, "confidence_alpha": config.drafter.confidence_alpha,
                      "loss": {SPECULATORS_NAMES[t]: w for t, w in (config.loss.terms or {"ce": 1.0}).items()},
                      "position_weights": "dpace" if config.loss.position_weights == "dpace" else "fixed-exp-decay"})
    drafter = setups["dspark"].drafter_config
    shape = {key: getattr(drafter, key) for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "rms_norm_eps", "max_position_embeddings", "sliding_window", "rope_theta", "block_size",
        "target_layer_ids", "mask_token_id", "vocab_size", "markov_rank")}
    shape["layer_types"] = list(drafter.layer_types)
    reference = run_reference(tmp_path, shape, setups["dspark"].config, cases, arrays)

    for name, _ in CASES:
        loss, confidence_loss, gradients, logits, confidence, _ = results[name]
        metric = {key.split("/metric/")[1]: value for key, value in reference.items()
                  if key.startswith(f"{name}/metric/")}
        close(loss, reference[f"{name}/loss"], f"{name}: loss")
        assert metric["loss_sum"] == pytest.approx(reference[f"{name}/loss"])
        # The drafter's logits (Markov-corrected for DSpark) at every slot of the valid anchors.
        close(logits[valid[name]].reshape(1, -1, logits.shape[-1]), reference[f"{name}/logits"], f"{name}: logits")
        if confidence is not None:
            close(np.asarray(confidence)[valid[name]].reshape(1, -1), reference[f"{name}/confidence"],
                  f"{name}: confidence logits")
            close(confidence_loss, metric["confidence_loss_sum"], f"{name}: confidence BCE")
        trained = {key.split("/grad/")[1] for key in reference if key.startswith(f"{name}/grad/")}
        assert trained == set(gradients), (name, trained ^ set(gradients))
        for weight in sorted(trained):
            close(gradients[weight], reference[f"{name}/grad/{weight}"], f"{name}: gradient of {weight}")

    # Each term alone against the value speculators reports for it in the weighted sum.
    for name, overrides in CASES:
        terms = overrides.get("loss.terms")
        if not terms:
            continue
        method = overrides.get("drafter.method", "dflash")
        for term in terms:
            config = tiny_config(*files, **{**overrides, "drafter.markov_rank": RANK, "drafter.sliding_window": WINDOW,
                                            "loss.terms": {term: 1.0},
                                            "drafter.confidence_alpha": 0.0})
            value = ours(setups[method], config, setups[method].state.params, batch)[0]
            close(value, reference[f"{name}/metric/{SPECULATORS_NAMES[term]}_loss_sum"], f"{name}: {term}")
