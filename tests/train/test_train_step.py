"""The jitted train step against an independent dense NumPy loss; labels vs noise; what moves; a mesh (every
mesh shape and both targets: test_sharding.py); gradient accumulation; the schedule and the FLOP count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dflash_jax.ops.anchors import AnchorGrid, DrafterInputs
from dflash_jax.ops.mask import position_mask
from dflash_jax.train import flops
from dflash_jax.train.optimizer import learning_rate_schedule
from dflash_jax.train.step import put_batch
from tests.train_fixtures import (build, loop_dpace, make_qwen3_5_target, make_target, mesh_of, one_step, tiny_config,
                                  write_corpus)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_step")
    return make_target(root / "target"), write_corpus(root / "train.jsonl")


@pytest.fixture(scope="module")
def hybrid_target(tmp_path_factory):
    return make_qwen3_5_target(tmp_path_factory.mktemp("train_step_qwen3_5") / "target")


def to_numpy(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def slot_loss(z, target_z, label, terms):
    """One slot's Σ weight·term (design §18) from full drafter logits z and target logits target_z."""
    log_q, log_p = z - z.max() - np.log(np.sum(np.exp(z - z.max()))), target_z - target_z.max()
    log_p = log_p - np.log(np.sum(np.exp(log_p)))
    q, p = np.exp(log_q), np.exp(log_p)
    m = (p + q) / 2
    values = {"ce": -log_q[label], "kl": np.sum(p * (log_p - log_q)), "rkl": np.sum(q * (log_q - log_p)),
              "jsd": 0.5 * np.sum(p * np.log(p / m)) + 0.5 * np.sum(q * np.log(q / m)),
              "tv": 0.5 * np.sum(np.abs(p - q))}
    return sum(weight * values[name] for name, weight in terms.items())


def reference_loss(setup, params, batch):
    """design §4 + §6 written out densely in NumPy: every slot's label, mask and weight, full [V] logits."""
    config, drafter_config = setup.config, setup.drafter_config
    grid = AnchorGrid(config.data.seq_len, config.data.anchor_stride, config.drafter.block_size)
    ids, pos, seg, lm = (np.asarray(batch[k]) for k in ("input_ids", "positions", "segment_ids", "loss_mask"))
    rows, length, block = ids.shape[0], config.data.seq_len, config.drafter.block_size
    target = nnx.merge(*nnx.split(setup.target))
    out = target(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), drafter_config.target_layer_ids)
    target_logits = np.asarray(target.logits(out.hidden))  # [rows, T, V], all of it

    block_ids = np.full((rows, grid.num_anchors, block), drafter_config.mask_token_id)
    block_ids[:, :, 0] = ids[:, grid.anchors]
    block_pos = pos[:, grid.anchors][:, :, None] + np.arange(block)
    drafter = nnx.merge(setup.spec.graphdef, params)
    inputs = DrafterInputs(grid, jnp.asarray(pos), jnp.asarray(block_pos.reshape(rows, -1)), jnp.asarray(seg),
                           jnp.asarray(seg[:, grid.anchors]))
    hidden, _ = drafter(out.features.reshape(rows, length, -1),
                        target.embed(jnp.asarray(block_ids.reshape(rows, -1))), inputs)
    logits = np.asarray(target.logits(hidden), np.float64).reshape(rows, grid.num_anchors, block, -1)

    ce = np.zeros((rows, grid.num_anchors, block))
    trained = np.zeros((rows, grid.num_anchors, block), bool)
    slot_correct, slot_count = np.zeros(block), np.zeros(block)
    for r in range(rows):
        for j, a in enumerate(grid.anchors):
            valid = a + 1 < length and lm[r, a] == 1 and lm[r, a + 1] == 1
            for k in range(1, block):
                p = a + k
                if not (valid and p < length and seg[r, p] == seg[r, a] and lm[r, p] == 1):
                    continue
                label = np.argmax(target_logits[r, p - 1]) if config.loss.labels == "target" else ids[r, p]
                z = logits[r, j, k]
                ce[r, j, k] = slot_loss(z, target_logits[r, p - 1].astype(np.float64), label,
                                        config.loss.terms or {"ce": 1.0})
                trained[r, j, k] = True
                slot_correct[k] += np.argmax(z) == label
                slot_count[k] += 1
    if config.loss.position_weights == "dpace":  # tests/train/test_dpace.py checks the weights themselves
        weights = loop_dpace(ce, trained, config.loss.dpace_alpha)
    else:
        weights = np.where(np.arange(block) >= 1, np.exp(-(np.arange(block) - 1) / config.loss.gamma), 0.0)
    return np.sum(weights * ce * trained) / trained.sum(), slot_correct, slot_count


@pytest.mark.parametrize("target_kind, labels, position_weights, terms",
                         [("qwen3", "target", "decay", None), ("qwen3", "data", "decay", None),
                          # the hybrid teacher's step, ~35 s; make test runs it on a mesh (test_sharding)
                          pytest.param("qwen3_5", "target", "decay", None, marks=pytest.mark.slow),
                          ("qwen3", "target", "dpace", None),
                          ("qwen3", "data", "decay", '{"ce": 0.2, "kl": 0.5, "rkl": 0.1, "jsd": 0.3, "tv": 0.9}')])
def test_step_loss_equals_dense_numpy_loss(files, hybrid_target, target_kind, labels, position_weights, terms):
    target_dir = hybrid_target if target_kind == "qwen3_5" else files[0]
    setup = build(tiny_config(target_dir, files[1], **{"loss.labels": labels,
                                                       "loss.position_weights": position_weights,
                                                       "loss.dpace_alpha": 0.3, "loss.terms": terms}), mesh_of())
    batch = next(setup.loader)
    params = jax.tree.map(jnp.copy, setup.state.params)  # the step donates the state it is given
    _, metrics = setup.step.train_step(setup.state, setup.target_state, put_batch(batch, setup.mesh), setup.total_steps)

    loss, slot_correct, slot_count = reference_loss(setup, params, batch)
    assert slot_count.sum() > 50  # the batch trains a fair number of slots
    np.testing.assert_array_equal(np.asarray(metrics["slot_count"]), slot_count)
    np.testing.assert_array_equal(np.asarray(metrics["slot_correct"]), slot_correct)
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=2e-6)


def test_noise_never_touches_labels_and_only_the_drafter_trains(files):
    clean = build(tiny_config(*files), mesh_of())
    noisy = build(tiny_config(*files, **{"loss.noise_std": 0.5}), mesh_of())
    batch = put_batch(next(clean.loader), clean.mesh)
    outputs = {}
    for name, setup in (("clean", clean), ("noisy", noisy)):
        teacher = jax.jit(setup.step.teacher)(setup.target_state, batch)
        outputs[name] = jax.jit(setup.step.drafter_loss)(setup.state.params, teacher, batch, jax.random.key(3), 1.0)
    (clean_loss, clean_aux), (noisy_loss, noisy_aux) = outputs["clean"], outputs["noisy"]
    np.testing.assert_array_equal(np.asarray(clean_aux.labels), np.asarray(noisy_aux.labels))
    assert abs(float(clean_loss) - float(noisy_loss)) > 1e-4  # the noise did reach the drafter

    target_before = to_numpy(noisy.target_state)
    initial = to_numpy(noisy.state.params)
    state = noisy.state
    for _ in range(4):
        state, _ = noisy.step.train_step(state, noisy.target_state, put_batch(next(noisy.loader), noisy.mesh),
                                         noisy.total_steps)
    jax.tree.map(np.testing.assert_array_equal, to_numpy(noisy.target_state), target_before)
    before = jax.tree_util.tree_flatten_with_path(initial)[0]
    after = jax.tree.leaves(to_numpy(state.params))
    unchanged = [jax.tree_util.keystr(path) for (path, old), new in zip(before, after) if np.array_equal(old, new)]
    assert not unchanged, f"drafter parameters that never moved: {unchanged}"
    assert int(state.step) == 4


# Muon orthogonalises in fp32 here: in bfloat16 the sharded products round differently from the unsharded ones.
@pytest.mark.parametrize("optimizer", [{}, pytest.param({"optim.name": "muon", "optim.muon_ns_dtype": "float32"},
                                                      marks=pytest.mark.slow)], ids=["adamw", "muon"])
def test_step_on_an_8_device_mesh_matches_one_device(files, optimizer):
    single = one_step(tiny_config(*files, **optimizer), mesh_of(), steps=3)
    sharded = one_step(tiny_config(*files, **optimizer, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),
                       mesh_of(data=2, fsdp=2, tensor=2), steps=3)
    for one, eight in zip(single, sharded):
        np.testing.assert_array_equal(eight["slot_count"], one["slot_count"])
        np.testing.assert_allclose(eight["loss"], one["loss"], rtol=1e-5)
        np.testing.assert_allclose(eight["grad_norm"], one["grad_norm"], rtol=1e-4)


@pytest.mark.parametrize("target_kind", ["qwen3", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_gradient_accumulation_matches_the_full_batch(files, hybrid_target, target_kind):
    target_dir = hybrid_target if target_kind == "qwen3_5" else files[0]
    full = one_step(tiny_config(target_dir, *files[1:]), mesh_of())
    accumulated = one_step(tiny_config(target_dir, *files[1:], grad_accum_steps=2), mesh_of())
    for one, two in zip(full, accumulated):
        np.testing.assert_array_equal(two["slot_count"], one["slot_count"])
        np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)
        np.testing.assert_allclose(two["grad_norm"], one["grad_norm"], rtol=1e-4)


def test_schedule_warms_up_linearly_then_decays_to_zero(files):
    config = tiny_config(*files, total_steps=100, **{"optim.warmup_ratio": 0.04, "optim.learning_rate": 1e-3})
    schedule = learning_rate_schedule(config, 100)
    assert float(schedule(0)) == 0.0
    np.testing.assert_allclose(float(schedule(2)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(4)), 1e-3, rtol=1e-6)
    assert float(schedule(52)) < 1e-3 and abs(float(schedule(100))) < 1e-12


@pytest.mark.parametrize("total_steps, warmup_ratio", [(100, 0.04), (1467, 0.04), (7, 0.1), (3, 0.0), (1, 0.04)])
def test_schedule_of_a_traced_length_is_optaxs_warmup_cosine(total_steps, warmup_ratio):
    """The step takes the schedule's length as an argument (one program for any length): its schedule, traced,
    equals optax.warmup_cosine_decay_schedule at every step, past the end included."""
    config = tiny_config("/unused", "unused.jsonl", **{"optim.warmup_ratio": warmup_ratio,
                                                        "optim.learning_rate": 6e-4})
    reference = optax.warmup_cosine_decay_schedule(0.0, 6e-4, warmup_steps=int(round(warmup_ratio * total_steps)),
                                                   decay_steps=total_steps, end_value=0.0)
    counts = jnp.arange(total_steps + 3)
    traced = jax.jit(lambda total: jax.vmap(learning_rate_schedule(config, total))(counts))(jnp.int32(total_steps))
    np.testing.assert_allclose(traced, jax.vmap(reference)(counts), rtol=1e-5, atol=1e-10)  # fp32 rounding


@pytest.mark.parametrize("window", [None, 5])
def test_visible_key_count_matches_the_mask(window):
    grid = AnchorGrid(seq_len=48, stride=4, block_size=6)
    assert flops.visible_keys(grid, window) == int(position_mask(grid, window).sum())


def test_peak_flops_come_from_config_then_the_device_table(files):
    class Device:
        device_kind = "TPU v5 lite"

    config = tiny_config(*files)
    assert flops.peak_tflops(config, Device()) == 197.0
    Device.device_kind = "cpu"
    assert flops.peak_tflops(config, Device()) is None
    config.peak_tflops_per_device = 100.0
    assert flops.peak_tflops(config, Device()) == 100.0


def test_init_from_an_exported_drafter_starts_from_its_weights(files, tmp_path, monkeypatch):
    from dflash_jax.models.drafter import Drafter
    from dflash_jax.train.state import init_train_state
    from dflash_jax.weights.drafter_files import drafter_to_torch_layout, export_drafter

    fresh = build(tiny_config(*files), mesh_of())
    source = Drafter(fresh.drafter_config, rngs=nnx.Rngs(7))
    export_drafter(source, fresh.drafter_config, tmp_path / "export")
    expected = {name: np.asarray(jnp.asarray(value, jnp.bfloat16), np.float32)  # the export is bf16
                for name, value in drafter_to_torch_layout(source).items()}
    setup = build(tiny_config(*files, **{"drafter.init_from": str(tmp_path / "export")}), mesh_of())
    loaded = drafter_to_torch_layout(nnx.merge(setup.spec.graphdef, setup.state.params))
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded[name], value, name)
    assert int(setup.state.step) == 0

    # The same export in a bucket (fake-gcs-server on loopback; design §7.1).
    gcs_server = pytest.importorskip("tests.gcs_fixture").gcs_server
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    config = tiny_config(*files, **{"drafter.init_from": "gs://models/drafter"})
    with gcs_server() as fs:
        fs.mkdir("models")
        fs.put(str(tmp_path / "export"), "models/drafter", recursive=True)
        state = init_train_state(setup.drafter_config, config, "xla", setup.spec)  # as `train` starts a run
    loaded = drafter_to_torch_layout(nnx.merge(setup.spec.graphdef, state.params))
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded[name], value, name)
