"""DFlash2 (design §18.4) against the installed vLLM speculators 0.9.0 (its `DFlash2DraftModel`, eager, fp32,
CPU; tests/train/speculators_dflash2.py in `.venv-speculators`): on the same weights, rows and anchors, the
drafter's unary logits, the selector's training candidates and their scores, and for several loss settings
(speculators' default KL with the fixed decay, CE with D-PACE, the other distribution terms, a selector weight)
the loss, its unary and selector terms and the gradient of every trained weight agree within 1e-4.

The project's step runs as training runs it (`make_step`'s `drafter_loss` on the frozen target's context);
speculators gets that target's features and final-normed hidden states, the project's anchor grid, and the
project's trained slots as its loss mask (its own mask is the loss mask at a+k; here the rows are packed side by
side into its one row, their documents apart), with full-attention layers (speculators' sliding layers mask
their window differently, and DFlash2's are bidirectional there).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.dflash2 import training_candidates
from dflash_jax.ops.anchors import DrafterInputs, slot_mask, slot_tokens
from dflash_jax.train import validate
from dflash_jax.train.selector import candidate_logits
from dflash_jax.train.step import anchor_grid, make_step
from dflash_jax.sharding import state_shardings
from dflash_jax.weights.drafter_files import drafter_to_torch_layout
from tests.train_fixtures import build, make_target, mesh_of, tiny_config, write_corpus

REPO = Path(__file__).resolve().parents[2]
REFERENCE_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
TOLERANCE = 1e-4
# name -> (config.loss overrides, selector alpha; speculators' loss spec and position weighting)
CASES = {
    "kl_decay": ({"terms": "kl", "position_weights": "decay"}, 1.0, "kl_div", "fixed-exp-decay"),
    "ce_dpace": ({"terms": None, "position_weights": "dpace", "dpace_alpha": 0.3}, 0.7, "ce", "dpace"),
    "terms_decay": ({"terms": {"rkl": 0.3, "jsd": 0.5, "tv": 0.9}, "position_weights": "decay"}, 1.0,
                    '{"rkl": 0.3, "jsd": 0.5, "tv": 0.9}', "fixed-exp-decay"),
}


def close(actual, expected, what: str) -> None:
    """Max |difference| within TOLERANCE of the expected values' scale (at least 1)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = max(1.0, float(np.abs(expected).max()))
    error = float(np.abs(actual - expected).max()) / scale
    assert error < TOLERANCE, f"{what}: relative error {error:.2e}"


def packed(batch, features, hidden, grid, slots):
    """The step's rows side by side in one row, every anchor of the grid in it (the blocks do not overlap), the
    project's trained slots as the loss mask at a+k, documents unique per row and padding in none."""
    rows, seq_len = batch["input_ids"].shape
    offsets = np.arange(rows)[:, None] * seq_len
    anchors = (offsets + grid.anchors[None, :]).reshape(-1)
    loss_mask = np.zeros(rows * seq_len, np.int64)
    loss_mask[anchors[:, None] + np.arange(grid.block_size)[None, :]] = slots.reshape(len(anchors), -1)
    segments = batch["segment_ids"].astype(np.int64)
    documents = np.where(segments > 0, segments + offsets, -1)

    def one_row(x):
        return np.ascontiguousarray(x).reshape(1, rows * seq_len, *x.shape[2:])

    return dict(hidden_states=one_row(features), input_ids=one_row(batch["input_ids"].astype(np.int64)),
                loss_mask=loss_mask[None], verifier_last_hidden_states=one_row(hidden),
                document_ids=one_row(documents), position_ids=one_row(batch["positions"].astype(np.int64)),
                anchors=anchors.astype(np.int64))


@pytest.mark.slow
def test_dflash2_logits_scores_losses_and_gradients_match_speculators(tmp_path):
    assert REFERENCE_PYTHON.exists(), ".venv-speculators is missing: `make venv-speculators` builds it"
    target_dir, train_file = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl")
    drafter_overrides = {"drafter.method": "dflash2", "drafter.layer_types": ("full_attention",) * 2,
                         "drafter.conv_group_size": 8, "drafter.selector_rank": 16, "drafter.selector_top_k": 8}
    config = tiny_config(target_dir, train_file, **drafter_overrides)
    setup = build(config, mesh_of())
    grid, block = anchor_grid(config), config.drafter.block_size
    batch = {key: jnp.asarray(value) for key, value in next(setup.loader).items()}
    teacher = jax.jit(setup.step.teacher)(setup.target_state, batch)
    hidden = setup.target(batch["input_ids"], batch["positions"], batch["segment_ids"],
                          setup.drafter_config.target_layer_ids).hidden

    # Convolutions and selector away from their initialisation (identity; codebooks of 0.02 barely score).
    drafter = nnx.merge(setup.spec.graphdef, setup.state.params)
    keys = iter(jax.random.split(jax.random.key(7), 4 * config.drafter.num_hidden_layers))
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = conv.base_kernel[...]
            conv.base_kernel.set_value(base + 0.3 * jax.random.normal(next(keys), base.shape))
            kernel = conv.kernel_projection.kernel[...]
            conv.kernel_projection.kernel.set_value(0.2 * jax.random.normal(next(keys), kernel.shape))
    selector = drafter.candidate_selector
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        codebook.set_value(codebook[...] * 40)
    params = nnx.state(drafter, nnx.Param)
    slots = np.asarray(slot_mask(batch["loss_mask"], batch["segment_ids"], grid.anchors, block))
    count = float(max(slots.sum(), 1))

    inputs = packed(jax.device_get(batch), np.asarray(teacher.features), np.asarray(hidden), grid, slots)
    shape = {**dataclasses.asdict(setup.drafter_config), "layer_types": list(setup.drafter_config.layer_types)}
    cases = {name: {"loss_fn": spec, "position_weights": weights, "gamma": config.loss.gamma,
                    "dpace_alpha": overrides.get("dpace_alpha", 0.5), "selector_alpha": alpha}
             for name, (overrides, alpha, spec, weights) in CASES.items()}
    weights = {f"weight/{name}": value for name, value in drafter_to_torch_layout(drafter).items()}
    in_file, out_file = tmp_path / "inputs.npz", tmp_path / "speculators.npz"
    np.savez(in_file, shape=json.dumps(shape), cases=json.dumps(cases),
             vocabulary=np.asarray(teacher.lm_head).T, **inputs, **weights)
    done = subprocess.run([str(REFERENCE_PYTHON), str(Path(__file__).with_name("speculators_dflash2.py")),
                           str(in_file), str(out_file)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = np.load(out_file)

    # The drafter's unary logits of every slot, and the selector on the drafted slots.
    hidden_out, _ = drafter(teacher.features, teacher.block_embeds,
                            DrafterInputs.from_rows(grid, batch["positions"], batch["segment_ids"]))
    logits = jnp.einsum("bqh,hv->bqv", hidden_out, teacher.lm_head)
    # Blocks anchored in a document (padding's blocks are never trained, and the two mask padding apart).
    in_document = np.repeat(np.asarray(batch["segment_ids"])[:, grid.anchors].reshape(-1) > 0, block)
    close(logits.reshape(-1, logits.shape[-1])[in_document], reference["logits"][in_document], "unary logits")
    rows = hidden_out.shape[0]
    drafted = hidden_out.reshape(rows, grid.num_anchors, block, -1)[:, :, 1:].reshape(rows, -1, hidden_out.shape[-1])
    labels = teacher.labels.reshape(rows, -1)
    ids, _ = training_candidates(logits.reshape(rows, grid.num_anchors, block, -1)[:, :, 1:].reshape(
        rows, drafted.shape[1], -1), labels, selector.top_k)
    predecessors = slot_tokens(batch["input_ids"], grid.anchors, block)[:, :, :-1].reshape(rows, -1)
    scores = selector.scores(drafted, predecessors, ids, candidate_logits(drafted, teacher.lm_head, ids, 24))
    drafted_rows = (np.arange(rows * grid.num_queries) % block) > 0
    compared = in_document[drafted_rows]
    np.testing.assert_array_equal(np.asarray(ids).reshape(-1, selector.top_k)[compared],
                                  reference["candidate_ids"][drafted_rows][compared])
    close(scores.reshape(-1, selector.top_k)[compared], reference["candidate_scores"][drafted_rows][compared],
          "selector scores")
    assert float(np.std(reference["candidate_scores"] - np.take_along_axis(
        reference["logits"], reference["candidate_ids"], axis=-1))) > 0.1  # the transition scores matter

    target_shardings = state_shardings(setup.target_state, setup.mesh, config.target_layout)
    target_graphdef = nnx.graphdef(setup.target)
    for name, (overrides, alpha, _, _) in CASES.items():
        case_config = tiny_config(target_dir, train_file, **drafter_overrides, **{"drafter.selector_alpha": alpha},
                                  **{f"loss.{field}": value for field, value in overrides.items()})
        validate.validate_config(case_config)
        step = make_step(case_config, setup.drafter_config, setup.spec, target_graphdef, target_shardings, setup.mesh)
        distribution = jax.jit(step.teacher)(setup.target_state, batch)
        (loss, aux), grads = jax.jit(jax.value_and_grad(step.drafter_loss, has_aux=True))(
            params, distribution, batch, jax.random.key(0), jnp.asarray(count))
        close(loss, reference[f"{name}/loss"], f"{name}: loss")
        close(aux.selector_loss, reference[f"{name}/selector_loss"], f"{name}: selector loss")
        close(loss - alpha * aux.selector_loss, reference[f"{name}/unary_loss"], f"{name}: unary loss")
        got = drafter_to_torch_layout(nnx.merge(setup.spec.graphdef, grads))
        for weight, value in got.items():
            expected = reference[f"{name}/grad/{weight}"]
            assert np.abs(expected).max() > 0, (name, weight)
            scale = float(np.abs(expected).max())
            error = float(np.abs(value - expected).max()) / scale
            assert error < TOLERANCE, f"{name}: gradient of {weight}: relative error {error:.2e}"
