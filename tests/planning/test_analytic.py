"""Candidates predicted without compiling (dflash_jax/planning/analytic.py): their memory against the compiled
step's on 8 simulated CPU devices, the ranking in hand-checked cases, `plan --compare` compiling only those
that could win, and `train` with a default mesh compiling one step."""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dflash_jax.planning import analytic
from dflash_jax.planning.chips import chip_named
from dflash_jax.planning.compare import Candidate, compare_plans, format_comparison
from dflash_jax.planning.plan import abstract_config, target_architecture
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.train import validate
from dflash_jax.train.loop import train
from dflash_jax.weights.targets import load_target
from tests.train_fixtures import make_target, tiny_config, write_corpus

LAYOUTS = ("replicate", "tensor", "fsdp")
H200 = chip_named("H200")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("analytic")
    return {"target": make_target(root / "qwen3"), "corpus": write_corpus(root / "train.jsonl")}


def _config(files, **overrides):
    return tiny_config(files["target"], files["corpus"], **{"data.batch_size": 8, **overrides})


def test_a_small_target_is_replicated_and_one_too_big_for_a_device_is_split_over_fsdp(files):
    """On tensor = 1 (8 devices on fsdp): the 6-layer target (1 MiB in fp32) fits every device whole, and then
    every layout does the same FLOPs and the same drafter traffic, but "fsdp" also all-gathers 7/8 of the
    target each step: "replicate" is first ("tensor" has its shardings there and is not a second candidate),
    "fsdp" predicted slower. A 48-layer target of 6.9 MiB on a 4 MiB budget: whole it fits no device, an
    eighth of it does, so "fsdp" is the one candidate left."""
    config = _config(files)
    target_config = target_architecture(config)
    small = analytic.predict_candidates(config, target_config, jax.devices(), 1, LAYOUTS, (1,), 80 * 2**30, H200)
    assert [p.layout for p in small] == ["replicate", "fsdp", "tensor"]
    replicate, fsdp, tensor = small
    assert replicate.fits and fsdp.fits and not tensor.fits and "replicate layout's shardings" in tensor.reason
    assert replicate.roofline.per_token[0] < fsdp.roofline.per_token[0]
    # The target's weights per device: whole, and an eighth (its norms, which do not divide, stay whole).
    target, _ = load_target(config.target_dir, param_dtype=jnp.float32)
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(target)))
    assert replicate.memory["target"] == whole and whole / 8 <= fsdp.memory["target"] < whole / 6
    gathered = fsdp.roofline.link_bytes["nvlink"] - replicate.roofline.link_bytes["nvlink"]
    assert gathered == 7 * fsdp.memory["target"]  # (n - 1) x its shard, as hlo_cost counts an all-gather

    deep = dataclasses.replace(target_config, num_hidden_layers=48)
    big = analytic.predict_candidates(config, deep, jax.devices(), 1, LAYOUTS, (1,), 4 * 2**20, H200)
    assert big[0].layout == "fsdp" and big[0].fits and big[0].memory["total"] <= 4 * 2**20
    assert big[0].memory["target"] < 2**20 and [p.fits for p in big[1:]] == [False, False]
    assert all(p.memory["target"] > 6 * 2**20 for p in big[1:])


def test_a_long_row_is_split_over_context(files):
    """Rows of 32K tokens: the context splits that leave a shard at least 4096 tokens are tried; one row on 8
    devices splits only over context = 8 (the others leave it to (data, fsdp) shards it cannot fill), and a
    device's temporaries fall with the split (design §19)."""
    assert analytic.context_sizes_for(4096) == (1,) and analytic.context_sizes_for(8192) == (1, 2)
    assert analytic.context_sizes_for(131072) == (1, 2, 4, 8, 16, 32)
    config = _config(files, **{"data.seq_len": 32768, "data.batch_size": 1})
    target_config = target_architecture(config)
    predictions = analytic.predict_candidates(config, target_config, jax.devices(), 1, ("replicate",), (1,), None,
                                              H200)
    assert sorted(p.mesh["context"] for p in predictions) == [1, 2, 4, 8]
    assert [(p.mesh["context"], p.mesh["fsdp"]) for p in predictions if p.fits] == [(8, 1)]
    drafter_config = validate.resolve_drafter_config(abstract_config(config), target_config, tokenizer=None)
    whole = {"target": 2**20, "params": 2**20}
    held = [analytic.temporaries(config, target_config, drafter_config, 1, dict(data=1, fsdp=1, tensor=1,
                                                                               context=context),
                                 "replicate", whole, 2**20, "xla") for context in (1, 2, 4, 8)]
    assert held == sorted(held, reverse=True) and held[0] > 4 * held[3]


def test_rows_that_do_not_split_make_no_candidate_and_the_choice_is_one_line(files):
    config = _config(files, **{"data.batch_size": 2})
    predictions = analytic.predict_candidates(config, target_architecture(config), jax.devices(), 1, ("fsdp",),
                                              (1, 2, 4, 8), None, H200)
    assert [(p.mesh["fsdp"], p.fits) for p in predictions] == [(2, True), (1, True), (8, False), (4, False)]
    assert predictions[-1].reason == "2 rows per micro-batch do not split over 4 (data, fsdp) shards"
    line = analytic.format_choice(predictions[0], predictions)
    assert line.startswith("fsdp layout on data=1,fsdp=2,tensor=4,context=1,dcn_data=1, of 4 candidates "
                           "(2 predicted not")
    assert "\n" not in line and "next: fsdp on data=1,fsdp=1,tensor=8,context=1,dcn_data=1 at " in line


@pytest.mark.slow  # three compiles of the tiny step (~30 s)
def test_compare_compiles_only_candidates_near_the_best_and_their_memory_agrees(files):
    """`plan --compare` with a margin of 1.3 on tensor 1 and 2: what it compiles is what the prediction put
    within 1.3x of its best; the rest are listed as predicted. For the compiled ones the exact parts (weights,
    optimizer state, batch) are the compiled step's, and the estimated total is within a factor 2 of XLA:CPU's
    (measured 1.3x-1.5x; its buffer assignment holds fp32 copies that libtpu does not: design §13)."""
    config = _config(files)
    candidates = compare_plans(config, target_architecture(config), jax.devices(), 1, LAYOUTS, (1, 2), chip=H200,
                               margin=1.3)
    best = min(c.prediction.roofline.per_token[0] for c in candidates if c.prediction.fits)
    compiled_times = set()  # (mesh, predicted time): a layout of the same time on the same mesh is not compiled
    for candidate in candidates:
        prediction, plan = candidate.prediction, candidate.plan
        same = (tuple(prediction.mesh.values()), prediction.roofline.per_token if prediction.fits else None)
        near = prediction.fits and prediction.roofline.per_token[0] <= 1.3 * best and same not in compiled_times
        assert (plan is not None) == near, candidate
        if plan is not None:
            compiled_times.add(same)
        elif near is False and same in compiled_times:
            assert "the same time as" in candidate.reason
        if plan is None:
            continue
        memory = prediction.memory
        assert (memory["target"], memory["params"], memory["opt_state"], memory["batch"]) == (
            plan.target_bytes, plan.params_bytes, plan.opt_state_bytes, plan.batch_bytes)
        assert 0.5 < plan.total_bytes / memory["total"] < 2.0, (candidate.layout, candidate.mesh)
    assert sum(c.plan is not None for c in candidates) < sum(c.prediction.fits for c in candidates)
    table = format_comparison(candidates)
    assert table.splitlines()[2].startswith("| replicate | data=1,fsdp=8,tensor=1,context=1,dcn_data=1 |")
    assert " | compiled |  |" in table and re.search(r"\| predicted \| predicted only: [\d.]+x the best", table)


@pytest.mark.slow  # compiles of the tiny step (~30 s)
def test_compare_moves_past_a_best_prediction_the_compiler_refuses(files, monkeypatch):
    """A candidate predicted best whose compile does not fit a device (a TPU compiler refuses such a program:
    plan_train_step's ConfigError) is listed with the reason, and the margin then counts from the best candidate
    that does fit, which is compiled though its prediction is not within the margin of the refused one."""
    import dflash_jax.planning.compare as compare

    real, refused = compare.plan_train_step, []

    def refuse_the_first(config, *args, **kwargs):
        if not refused:
            refused.append(dict(config.mesh))
            raise ConfigError("the train step does not fit a device: the compiler says Ran out of memory on HBM")
        return real(config, *args, **kwargs)

    monkeypatch.setattr(compare, "plan_train_step", refuse_the_first)
    config = _config(files)
    candidates = compare_plans(config, target_architecture(config), jax.devices(), 1, LAYOUTS, (1, 2), chip=H200,
                               margin=1.0)
    (first,) = [c for c in candidates if "Ran out of memory" in c.reason]
    assert first.plan is None and {k: first.mesh[k] for k in refused[0]} == refused[0]
    fitting = [c for c in candidates if c.plan is not None and not c.reason]
    assert fitting and candidates[0] is fitting[0]  # ranked first: the best that fits once compiled
    best = fitting[0].prediction.roofline.per_token[0]
    for candidate in candidates:  # margin 1.0 from the fitting one: nothing slower was compiled
        if candidate.plan is not None:
            assert candidate.prediction.roofline.per_token[0] <= best * (1 + 1e-9)


def test_train_with_a_default_mesh_compiles_one_step(files, tmp_path, monkeypatch, caplog):
    """config.mesh left at its defaults on devices of a known chip (the 8 CPU devices taken as H200s): train
    chooses the mesh and layout from the predictions, logs the choice in one line and compiles that step alone
    (jax's compile log), which the run's loop then runs."""
    monkeypatch.setattr("dflash_jax.train.startup.chip_of_kind", lambda kind: H200)
    config = _config(files, **{"data.batch_size": 2, "total_steps": 1, "hbm_gib": 1.0, "target_layout": "auto",
                               "eval_every": 0})
    config.mesh.update(data=1, fsdp=-1, tensor=1, dcn_data=1, context=1)
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.INFO):
            summary = train(config, tmp_path / "run")
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = re.findall(r"Finished XLA compilation of \S*train_step", caplog.text)
    assert len(compiles) == 1, compiles
    chosen = re.findall(r"config.mesh left at its defaults: (\w+) layout on data=1,fsdp=(\d),tensor=(\d),"
                        r"context=1,dcn_data=1, of 12 candidates", caplog.text)
    assert len(chosen) == 1 and int(chosen[0][1]) * int(chosen[0][2]) == 8 and int(chosen[0][1]) <= 2
    assert summary["final_step"] == 1 and "plan:" in caplog.text
    config.hbm_gib = 1e-4
    with pytest.raises(ConfigError, match="no mesh of the 8 devices fits the train step in 0.0 GiB per device"):
        train(config, tmp_path / "other")


def test_each_candidate_names_where_the_experts_lie(files):
    """The Qwen3.6-35B-A3B recipe (no checkpoint) on the 8 devices taken as H200s: the rule table splits the 256
    experts over tensor in the fsdp and tensor layouts (each expert's hidden axis over fsdp in the fsdp layout)
    and keeps them whole in the replicate layout; `plan --compare`'s table has a column of it (design §13)."""
    from configs import qwen36_35b_a3b

    config = qwen36_35b_a3b.get_config()
    config.data.seq_len, config.data.anchor_stride, config.query_chunk_blocks = 256, 8, 8
    predictions = analytic.predict_candidates(config, qwen36_35b_a3b.target_config(), jax.devices(), 1, LAYOUTS,
                                              (1, 8), None, H200)
    placed = {(p.layout, p.mesh["tensor"]): p.experts for p in predictions}
    assert placed == {("fsdp", 1): "256 on every device, hidden over fsdp=8",
                      ("fsdp", 8): "256 over tensor=8 (32 a device)",
                      ("tensor", 1): "256 on every device", ("tensor", 8): "256 over tensor=8 (32 a device)",
                      ("replicate", 1): "256 on every device", ("replicate", 8): "256 on every device"}
    # Split over fsdp = 8 or tensor = 8, a device holds an eighth of the target (the norms and the router whole).
    by_layout = {(p.layout, p.mesh["tensor"]): p.memory["target"] for p in predictions}
    assert abs(by_layout[("fsdp", 1)] / by_layout[("tensor", 8)] - 1) < 0.01
    assert 7.9 < by_layout[("replicate", 1)] / by_layout[("tensor", 8)] <= 8
    table = format_comparison([Candidate(p.layout, p.mesh, None, p.reason, p) for p in predictions])
    assert table.splitlines()[0].startswith("| layout | mesh (per slice or host) | experts | memory per device |")
    assert "| tensor | data=1,fsdp=1,tensor=8,context=1,dcn_data=1 | 256 over tensor=8 (32 a device) |" in table
    assert analytic.expert_placement(target_architecture(_config(files)), "fsdp", predictions[0].mesh) == ""
