"""A training workdir in a bucket (fake-gcs-server on loopback, tests/gcs_fixture.py): metrics.jsonl keeps
every record across resumes although object stores have no append, each record is in the bucket as soon as it
is written, and the lock and the config history work there as on a local disk; a model directory there is
copied once into the local cache, and an output there obeys the local ownership rules (design §7.1)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from dflash_jax.runtime.errors import OutputDirError, WorkdirLockedError
from dflash_jax.runtime.workdir import (MetricsLog, WorkdirLock, append_config_history, config_of_step,
                                      drop_metrics_after, read_metrics)
from dflash_jax.runtime.paths import as_path
from dflash_jax.weights.hub import local_dir
from dflash_jax.weights.output_dir import check_output_dir, prepare_output_dir, staged_output
from tests.gcs_fixture import gcs_server


def test_bucket_metrics_survive_resumes_and_each_record_is_stored_when_written(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))  # where the file is staged before each upload
    with gcs_server() as fs:
        fs.mkdir("runs")
        workdir = as_path("gs://runs/a")
        first = MetricsLog(workdir)
        for step in (1, 2, 3):
            first.write({"step": step, "loss": 1.0 / step})
            # Read by another client: stored now, not when the run ends (a killed run keeps its records).
            assert [r["step"] for r in read_metrics(workdir)] == list(range(1, step + 1))
        # Killed without close; the resume restarts from the checkpoint of step 2 and logs step 3 again.
        drop_metrics_after(workdir, 2)
        second = MetricsLog(workdir)
        second.write({"step": 3, "loss": 0.5})
        second.write({"step": 4, "loss": 0.25})
        second.close()
        assert read_metrics(workdir) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5},
                                         {"step": 3, "loss": 0.5}, {"step": 4, "loss": 0.25}]
        assert fs.cat("runs/a/metrics.jsonl").decode().count("\n") == 4


def test_a_bucket_workdir_lock_refuses_a_second_trainer_and_the_config_history_grows():
    with gcs_server() as fs:
        fs.mkdir("runs")
        workdir = as_path("gs://runs/b")
        lock = WorkdirLock(workdir)
        lock.acquire()
        assert json.loads(fs.cat("runs/b/lock.json"))["pid"] == os.getpid()
        lock.release()
        assert not fs.exists("runs/b/lock.json")
        # A trainer that is alive (another process on this host, heartbeat fresh) holds it: refused.
        fs.pipe("runs/b/lock.json", json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                "heartbeat": time.time()}).encode())
        with pytest.raises(WorkdirLockedError, match="another trainer is running"):
            WorkdirLock(workdir).acquire()
        for step, rate in ((0, 1e-3), (20, 5e-4)):
            append_config_history(workdir, ConfigDict({"learning_rate": rate}), step)
        assert config_of_step(workdir, 20)["learning_rate"] == 1e-3
        assert config_of_step(workdir, 30)["learning_rate"] == 5e-4


def test_a_bucket_lock_is_created_by_one_trainer_and_a_stale_one_taken_over_by_one():
    """The lock is an exclusive create (ifGenerationMatch=0), and a takeover removes only the generation judged
    stale: of two trainers that both found the stale lock, the later one cannot remove the first one's new lock."""
    with gcs_server() as fs:
        fs.mkdir("runs")
        workdir = as_path("gs://runs/c")
        first, second = WorkdirLock(workdir), WorkdirLock(workdir)
        first._holder["pid"] = os.getppid()  # a live process: our own pid would read as a previous life of ours
        assert first._create() and not second._create()
        assert json.loads(fs.cat("runs/c/lock.json"))["token"] == first._holder["token"]
        fs.rm("runs/c/lock.json")
        fs.pipe("runs/c/lock.json", json.dumps({"host": "gone", "pid": 1, "heartbeat": 0.0}).encode())
        stale, _ = second._read_generation()
        first.acquire()  # takes over the stale lock
        second._remove(stale)
        assert json.loads(fs.cat("runs/c/lock.json"))["token"] == first._holder["token"]
        with pytest.raises(WorkdirLockedError, match=f"pid {os.getppid()}"):
            second.acquire()
        first.release()
        assert not fs.exists("runs/c/lock.json")


def test_a_bucket_model_directory_is_copied_once_and_again_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    with gcs_server() as fs:
        fs.mkdir("models")
        fs.pipe({"models/m/config.json": b"{}", "models/m/model.safetensors": b"weights",
                 "models/m/params/array": b"left in the bucket", "models/m/notes.md": b"not a model file"})
        copy = Path(local_dir("gs://models/m"))
        assert sorted(p.name for p in copy.iterdir() if not p.name.startswith(".")) == ["config.json",
                                                                                     "model.safetensors"]
        (copy / "model.safetensors").write_bytes(b"weights")  # the same version: not fetched again
        stamp = (copy / ".model.safetensors.version").stat().st_mtime_ns
        assert local_dir("gs://models/m") == str(copy)
        assert (copy / ".model.safetensors.version").stat().st_mtime_ns == stamp
        fs.pipe("models/m/model.safetensors", b"new weights")  # same name, another object
        local_dir("gs://models/m")
        assert (copy / "model.safetensors").read_bytes() == b"new weights"


def test_a_bucket_output_is_checked_like_a_local_one_and_replaced_whole(tmp_path):
    with gcs_server() as fs:
        fs.mkdir("out")
        fs.pipe("out/foreign/data.bin", b"x")
        with pytest.raises(OutputDirError, match="not empty"):
            check_output_dir("gs://out/foreign", kind="drafter export", inputs=[], overwrite=False)
        with pytest.raises(OutputDirError, match="no dflash_output.json"):
            check_output_dir("gs://out/foreign", kind="drafter export", inputs=[], overwrite=True)
        with pytest.raises(OutputDirError, match="lies inside the input gs://out"):
            check_output_dir("gs://out/x", kind="drafter export", inputs=["gs://out"], overwrite=False)
        for text in ("first", "second"):
            check_output_dir("gs://out/export", kind="drafter export", inputs=[], overwrite=True)
            with staged_output("gs://out/export") as local:
                prepare_output_dir(local, kind="drafter export", entries=["a.txt"], inputs=[], overwrite=False)
                (local / "a.txt").write_text(text)
                assert not fs.exists("out/export/a.txt") or fs.cat_file("out/export/a.txt") == b"first"
            assert sorted(fs.ls("out/export")) == ["out/export/a.txt", "out/export/dflash_output.json"]
            assert fs.cat_file("out/export/a.txt").decode() == text
