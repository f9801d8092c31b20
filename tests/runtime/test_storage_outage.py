"""Storage that does not answer never hangs a command (design §7.2): with STORAGE_EMULATOR_HOST naming a port
nothing listens on (a stopped server), a gs:// read is given up within config.storage's deadline with one
StorageOutage naming the operation and the path, and TensorStore is pointed at the same endpoint."""

from __future__ import annotations

import os
import socket
import time

import pytest

pytest.importorskip("gcsfs")

from dflash_jax.runtime import paths, storage  # noqa: E402


def test_a_stopped_server_is_an_outage_within_the_deadline_naming_the_path(monkeypatch):
    with socket.socket() as probe:  # a port that was free a moment ago: connections to it are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
    monkeypatch.setattr(storage, "SETTINGS", storage.Settings(deadline_seconds=3.0, retries=2))
    fs, key = paths.filesystem("gs://bucket/run/metrics.jsonl")
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(storage.StorageOutage, match="storage outage: GET .*bucket.*run.*metrics.jsonl"):
        fs.exists(key)
    assert time.monotonic() - start < 3.0 + 5.0  # the deadline, plus a margin for a loaded machine
    fs.clear_instance_cache()
