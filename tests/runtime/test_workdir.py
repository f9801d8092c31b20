"""Workdir addressing: a bucket URI stays a URI on every path the train loop, the checkpointer, the export and
evaluation build from it (pathlib would collapse gs://bucket/run into the local relative path gs:/bucket/run)."""

from __future__ import annotations

import os

from dflash_jax.runtime.paths import as_path
from dflash_jax.weights.drafter_files import CHECKPOINTS_DIR


def test_bucket_uris_stay_uris():
    workdir = as_path("gs://bucket/runs/one")
    assert os.fspath(workdir / CHECKPOINTS_DIR) == "gs://bucket/runs/one/checkpoints"
    assert os.fspath(workdir / "config.json") == "gs://bucket/runs/one/config.json"


def test_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert os.fspath(as_path("runs/one")) == os.fspath(tmp_path / "runs" / "one")
    assert os.fspath(as_path(tmp_path / "two")) == os.fspath(tmp_path / "two")
