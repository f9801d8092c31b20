"""Experiment tracking: the train loop's TensorBoard event files, read back with TensorBoard's own reader, hold
the logged values; after a crash and a resume each step shows once; W&B is only imported when asked for."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from dflash_jax.runtime.errors import ConfigError
from dflash_jax.train.loop import train
from dflash_jax.train.tracking import TENSORBOARD_DIR, Trackers, scalar_metrics
from tests.train_fixtures import make_target, tiny_config, write_corpus


def metrics_records(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_event_files_hold_the_logged_values_and_each_step_once_after_a_resume(tmp_path):
    config = tiny_config(make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl"),
                         total_steps=12, log_every=2, checkpoint_every=8, eval_every=4)
    workdir = tmp_path / "run"
    evaluate = lambda step, drafter, target: {"tau": 1 + step / 100}  # noqa: E731  (stands in for exact τ)
    train(config, workdir, evaluate=evaluate)  # logs steps 2..12, checkpoints at 8 and 12
    shutil.rmtree(workdir / "checkpoints" / "12")  # as if the run died after logging 12, before saving it
    resumed = train(config, workdir, evaluate=evaluate)
    assert resumed["start_step"] == 8

    # The resumed run's event file starts with TensorBoard's purge marker at the first step it logs again.
    event_files = sorted((workdir / TENSORBOARD_DIR).iterdir())
    assert len(event_files) == 2
    markers = [(event.step, event.session_log.status) for event in EventFileLoader(str(event_files[1])).Load()
               if event.HasField("session_log")]
    assert markers[0] == (9, 1)  # SessionLog.START

    accumulator = EventAccumulator(str(workdir / TENSORBOARD_DIR))
    accumulator.Reload()
    latest = {}  # step -> the record the resumed run wrote (metrics.jsonl keeps what it is given, in order)
    for record in metrics_records(workdir):
        latest.setdefault(record["step"], {}).update(record)
    tags = accumulator.Tags()["scalars"]
    for tag in ("train/loss", "train/acc_1", "train/eal", "train/tau_est", "train/learning_rate", "train/grad_norm",
                "train/tokens_per_second", "train/step_time", "eval/tau"):
        assert tag in tags, tag
        events = accumulator.Scalars(tag)
        steps = [event.step for event in events]
        assert steps == sorted(set(steps)), f"{tag}: {steps}"  # each step once
        assert steps == (list(range(4, 13, 4)) if tag == "eval/tau" else list(range(2, 13, 2))), tag
        name = tag if tag.startswith("eval/") else tag.removeprefix("train/")
        for event in events:
            assert event.value == pytest.approx(latest[event.step][name], rel=1e-6), (tag, event.step)
    assert "train/mfu" not in tags  # None on CPU (no known peak): not logged, not logged as 0


def test_non_numbers_are_left_out_and_metrics_are_grouped():
    assert scalar_metrics({"step": 3, "loss": 1.5, "mfu": None, "eval/tau": 2, "flag": True}) == {
        "train/loss": 1.5, "eval/tau": 2.0}


def test_tensorboard_off_writes_nothing_and_wandb_needs_its_package(tmp_path):
    config = tiny_config(tmp_path, tmp_path / "train.jsonl", tensorboard=False)
    Trackers(tmp_path, config, 0).close()
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed; this checks the message a run without it gives")
    config.wandb_project = "dflash"
    with pytest.raises(ConfigError, match=r"config.wandb_project is set but wandb is not installed"):
        Trackers(tmp_path, config, 0)


def test_a_bucket_workdirs_event_files_go_through_the_bounded_filesystem_and_no_local_disk(tmp_path, monkeypatch):
    from tests.gcs_fixture import gcs_server

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    with gcs_server() as fs:
        fs.mkdir("dflash")
        trackers = Trackers("gs://dflash/run", tiny_config(tmp_path, tmp_path / "train.jsonl"), 0)
        trackers.write(1, {"step": 1, "loss": 1.5})
        trackers.write(2, {"step": 2, "loss": 1.25})
        trackers.close()
        names = fs.find(f"dflash/run/{TENSORBOARD_DIR}")
        assert len(names) == 1 and "tfevents" in names[0]
        fs.get(names[0], str(tmp_path / "copy" / names[0].rsplit("/", 1)[1]))
    accumulator = EventAccumulator(str(tmp_path / "copy"))
    accumulator.Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("train/loss")] == [(1, 1.5), (2, 1.25)]
    assert not (tmp_path / "cache").exists()
