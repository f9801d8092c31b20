"""A training workdir in a bucket (fake-gcs-server on loopback, tests/gcs_fixture.py): metrics.jsonl keeps
every record across resumes although object stores have no append, each record is in the bucket as soon as it
is written, and the lock and the config history work there as on a local disk (design §7)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from ml_collections import ConfigDict

from dflash_jax.errors import WorkdirLockedError
from dflash_jax.train.workdir import (MetricsLog, WorkdirLock, append_config_history, config_of_step,
                                      drop_metrics_after, read_metrics)
from dflash_jax.weights.drafter_files import workdir_path
from tests.gcs_fixture import gcs_server


def test_bucket_metrics_survive_resumes_and_each_record_is_stored_when_written():
    with gcs_server() as fs:
        fs.mkdir("runs")
        workdir = workdir_path("gs://runs/a")
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
        workdir = workdir_path("gs://runs/b")
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
