"""Paths the commands take, local or at a URL (gs://bucket/..., any scheme fsspec knows) (design §7.1).

Input files read once in order (evaluation records, prompts) are streamed from their URL (`open_input`). A
workdir is addressed as an `etils.epath.Path` (`as_path`), as Orbax addresses its checkpoints, so its small
files are read and written in the bucket itself. A model directory at a URL (a target, a drafter to start from
or evaluate) is read through `local_copy`: its top-level files are downloaded once into a local cache and read
from there, since the safetensors and tokenizer readers take local files only (an Orbax target's arrays, in a
subdirectory, stay in the bucket: Orbax reads them there, each host its own shards). A file a command grows at a
URL (metrics.jsonl, regenerate's output) is a `StagedFile`: written locally and uploaded whole, since object
stores have no append. Every remote path is reached through `as_path` or `filesystem`, which first point every
storage client at the same endpoint and bound its operations (runtime/storage.py, design §7.2).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from etils import epath

from dflash_jax.runtime import storage
from dflash_jax.runtime.errors import DiskFullError


def is_url(path: str | os.PathLike) -> bool:
    """Whether `path` names an object in a store (gs://bucket/...), not a local file."""
    return "://" in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
    """`path` as one `epath.Path`: a URL stays one (pathlib would turn gs://bucket/run into the local path
    gs:/bucket/run); a local path is made absolute, as Orbax requires."""
    text = os.fspath(path)
    if not is_url(text):
        return epath.Path(os.path.expanduser(text)).absolute()
    storage.connect()
    return epath.Path(text)


def filesystem(url: str):
    """(the fsspec filesystem of `url`, the path within it); a gs:// one bounded (runtime/storage.py)."""
    import fsspec  # noqa: PLC0415 (only remote paths need it)

    storage.connect()
    return fsspec.core.url_to_fs(url)


def open_input(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for reading bytes, from the start to the end (evaluation and prompt files are read
    once, in order: one request streams a URL's object)."""
    if not is_url(path):
        return open(path, "rb")
    fs, key = filesystem(os.fspath(path))
    return fs.open(key, "rb")


def absolute(path: str | os.PathLike) -> str:
    """`path` as recorded in a run's settings: a URL as it is, a local path made absolute."""
    return os.fspath(path) if is_url(path) else os.path.abspath(path)


def cache_root() -> Path:
    """Where `local_copy` keeps its copies: $DFLASH_JAX_CACHE, else ~/.cache/dflash_jax."""
    return Path(os.environ.get("DFLASH_JAX_CACHE") or Path.home() / ".cache" / "dflash_jax")


def cached_path(url: str) -> Path:
    """The local place of `url`'s copy (or staged upload) in the cache: <cache>/urls/<scheme>/<bucket>/<key>."""
    return cache_root() / "urls" / url.replace("://", "/", 1).rstrip("/")


# A full disk, a full quota, a file-size limit: no room left where a local file was being written.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@contextlib.contextmanager
def local_space(directory: str | os.PathLike, what: str) -> Iterator[None]:
    """While active, running out of space in the local `directory` is one DiskFullError naming it and `what`
    was being written there, not an OSError from deep inside a writer. Whoever stages files for a store writes
    them locally first and uploads only what is whole, so the store still holds everything uploaded before."""
    try:
        yield
    except Exception as error:
        reason = _no_space(error)
        if reason is None:
            raise
        elsewhere = next((f" (or set {variable} to a directory with room)" for variable, root in (
            ("DFLASH_JAX_CACHE", cache_root()), ("TMPDIR", Path(tempfile.gettempdir())))
            if Path(directory).is_relative_to(root)), "")
        raise DiskFullError(f"{directory}: no space left on its disk ({reason}) while writing {what}; free "
                            f"space there{elsewhere} and rerun the same command: what was saved before is kept") \
            from None


def _no_space(error: BaseException) -> str | None:
    """The OS's words if `error` says a disk had no room: an OSError, or a library's own error quoting the OS's
    code (safetensors: "I/O error: No space left on device (os error 28)"); else None."""
    if isinstance(error, OSError):
        return error.strerror if error.errno in _NO_SPACE else None
    return next((os.strerror(code) for code in _NO_SPACE if f"(os error {code})" in str(error)), None)


class StagedFile:
    """A file at a URL that a command grows (design §7.1): an object store has no append (gcsfs's "a" mode
    starts a new, empty object) and an open object reaches the store only when closed, so the file is kept
    locally at `local`, written there with ordinary file calls, and `upload` replaces the object with it whole;
    an upload replaces the object at once, so a reader sees the old content or the new, never a torn line.
    `local` starts as the object's content (absent if there is none): the store, not a copy some killed job
    left in the cache, is what a rerun continues."""

    def __init__(self, url: str):
        self._fs, self._key = filesystem(url)
        self.local = cached_path(url)
        with self.space():
            self.local.parent.mkdir(parents=True, exist_ok=True)
            if self._fs.exists(self._key):
                self._fs.get_file(self._key, os.fspath(self.local))
            else:
                self.local.unlink(missing_ok=True)

    def space(self):
        """`local_space` of the local copy: wraps each write to it."""
        return local_space(self.local.parent, f"the local copy of {self._fs.unstrip_protocol(self._key)}")

    def upload(self) -> None:
        self._fs.put_file(os.fspath(self.local), self._key)


def local_copy(url: str, patterns: Sequence[str]) -> str:
    """A local directory holding the files directly under `url` whose names match one of `patterns`; each is
    downloaded only if the cache lacks it or holds another version of it (size and checksum or ETag, as the
    store lists them, kept beside the copy). Written under a name of this process and renamed, so that
    processes sharing a host (and the cache) never read a half-written file."""
    fs, root = filesystem(url)
    local = cached_path(url)
    local.mkdir(parents=True, exist_ok=True)
    for entry in fs.ls(root, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry["type"] != "file" or not any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
            continue
        destination, stamp = local / name, local / f".{name}.version"
        version = f"{entry['size']} {entry.get('md5Hash') or entry.get('ETag') or entry.get('etag') or ''}"
        if destination.is_file() and stamp.is_file() and stamp.read_text() == version:
            continue
        partial = local / f".{name}.{os.getpid()}.partial"
        try:
            with local_space(local, f"the copy of {fs.unstrip_protocol(entry['name'])}"):
                fs.get_file(entry["name"], os.fspath(partial))
                os.replace(partial, destination)
                stamp.write_text(version)
        finally:
            partial.unlink(missing_ok=True)  # not left to fill the disk
    return os.fspath(local)
