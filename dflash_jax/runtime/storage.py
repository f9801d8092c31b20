"""Remote storage that stalls or fails never hangs a command (design §7.2).

- **One endpoint for every client.** gcsfs (and so etils.epath, which reaches gs:// through it) and Google's own
  clients read STORAGE_EMULATOR_HOST (a local GCS-protocol server: an emulator, no credentials); TensorStore,
  which reads and writes Orbax's arrays, reads TENSORSTORE_GCS_HTTP_URL and a fixed token instead, and without
  them keeps retrying the real endpoint. `connect` maps the first onto the second (and DFLASH_JAX_GCS_ENDPOINT,
  a private endpoint reached with the usual credentials, onto both) before any client is made.
- **Bounded operations.** Every HTTP call gcsfs makes (reads, writes, listings, uploads, downloads) goes
  through `BoundedGCSFileSystem` (gcsfs's JSON API class, the only gs:// filesystem the commands use): retried
  with exponential backoff at most `Settings.retries` times, and given up after `Settings.deadline_seconds` (plus
  time for its bytes at `SLOWEST_BYTES_PER_SECOND`), raising `StorageOutage`, which every command reports as one
  line and exit code `EXIT_STORAGE_OUTAGE`, at most `end_commands_after_outages`' seconds after it. What runs in
  TensorStore's own threads (checkpoint saves and restores) cannot be interrupted from Python: a `Deadline`
  watchdog ends the process with the same line and code instead, which is as safe as a kill (design §7).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import parse_qs, unquote

log = logging.getLogger(__name__)

# Exit codes a launcher acts on (docs/failure_handling.md lists them all): a storage outage, retryable by rerunning
# the command, which resumes (74 = EX_IOERR).
EXIT_STORAGE_OUTAGE = os.EX_IOERR
EMULATOR_ENV, ENDPOINT_ENV = "STORAGE_EMULATOR_HOST", "DFLASH_JAX_GCS_ENDPOINT"
_TENSORSTORE_URL_ENV, _TENSORSTORE_TOKEN_ENV = "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING"
DEADLINE_ENV, RETRIES_ENV = "DFLASH_JAX_STORAGE_DEADLINE_SECONDS", "DFLASH_JAX_STORAGE_RETRIES"
# A transfer of n bytes gets n / SLOWEST_BYTES_PER_SECOND seconds beyond the deadline (a 50 GB target file may
# take minutes to download; a stall of the deadline's length with nothing moving is an outage).
SLOWEST_BYTES_PER_SECOND = 8 * 2**20
_BACKOFF_FIRST, _BACKOFF_MAX = 1.0, 30.0


@dataclasses.dataclass
class Settings:
    """How long one storage operation may take in all (seconds) and how many times a failed attempt is
    retried. Defaults a long job lives with: a bucket that answers again within 10 minutes costs nothing."""
    deadline_seconds: float = 600.0
    retries: int = 8


SETTINGS = Settings(deadline_seconds=float(os.environ.get(DEADLINE_ENV) or Settings.deadline_seconds),
                    retries=int(os.environ.get(RETRIES_ENV) or Settings.retries))


def configure(storage_config) -> None:
    """Takes config.storage's fields that are set (None keeps the environment's value or the default)."""
    for field in dataclasses.fields(Settings):
        value = storage_config.get(field.name) if storage_config is not None else None
        if value is not None:
            setattr(SETTINGS, field.name, int(value) if field.type == "int" else float(value))


# In a command, the most seconds between an outage and the end of the process (`StorageOutage`).
_end_after_outage: float | None = None


def end_commands_after_outages(seconds: float = 10.0) -> None:
    """Makes every later StorageOutage end the process at the latest `seconds` after it (command-line entry
    points call this; a library caller keeps the exception to itself)."""
    global _end_after_outage
    _end_after_outage = seconds


class StorageOutage(Exception):
    """A storage operation that did not succeed within its deadline and retries. Not an OSError, so that no
    caller mistakes it for a missing file (and, say, starts a file afresh over one it could not read).

    In a command (`end_commands_after_outages`) an outage ends the process: its line and exit code come at the
    latest that many seconds after it, the time the callers it unwinds through have to close their files; each
    of those that needs the same storage would otherwise wait out a deadline of its own. A caller that lives on
    after an outage (the workdir lock's heartbeat) calls `forgive`."""

    def __init__(self, operation: str, path: str, reason: str):
        super().__init__(_outage_message(operation, path, reason))
        self.operation, self.path = operation, path
        self._ending = None if _end_after_outage is None else Deadline.start(
            _end_after_outage, lambda: str(self), EXIT_STORAGE_OUTAGE)

    def forgive(self) -> None:
        if self._ending is not None:
            Deadline.end(self._ending)


def _outage_message(operation: str, path: str, reason: str) -> str:
    return (f"storage outage: {operation} {path} failed ({reason}); nothing is lost: rerun the same command when "
            f"the storage answers again (exit code {EXIT_STORAGE_OUTAGE})")


# TensorStore's words (absl status codes) for a request that found no server or no answer: its own retries ran
# out, which says nothing about the data.
_UNANSWERED_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def outage_in(error: BaseException, operation: str, path: str) -> StorageOutage | None:
    """The storage outage behind `error`, if it is one: a StorageOutage anywhere in its chain (raised in a
    library's thread, say Orbax's background save, and wrapped), or TensorStore's report of an unanswered
    request. None for any other failure (a damaged file, a bug)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, StorageOutage):
            return error
        if str(error).lstrip().startswith(_UNANSWERED_STATUS):
            return StorageOutage(operation, path, (str(error).strip().splitlines() or [""])[0])
        error = error.__cause__ or error.__context__
    return None


def report_and_exit(message: str, code: int) -> None:
    """One `error:` line on stderr, then the process ends at once (threads stuck in a storage client included)."""
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    os._exit(code)


# --- one endpoint for every client -------------------------------------------------------------------------

_derived: dict[str, str] = {}  # what `connect` last set, so that a value the user set is never replaced


def connect() -> None:
    """Points TensorStore at the endpoint gcsfs uses and makes gs:// filesystems bounded ones; cheap and
    idempotent, called before any remote path is used (runtime/paths.py)."""
    endpoint = os.environ.get(ENDPOINT_ENV) or os.environ.get(EMULATOR_ENV)
    wanted = {}
    if endpoint and endpoint != "default":
        wanted[_TENSORSTORE_URL_ENV] = endpoint if "://" in endpoint else f"http://{endpoint}"
        if not os.environ.get(ENDPOINT_ENV):  # an emulator takes any token; a real endpoint needs credentials
            wanted[_TENSORSTORE_TOKEN_ENV] = "emulator"
    for name in (_TENSORSTORE_URL_ENV, _TENSORSTORE_TOKEN_ENV):
        ours = name in _derived and os.environ.get(name) == _derived[name]
        if name in os.environ and not ours:
            continue  # set by the user
        if name in wanted:
            os.environ[name] = _derived[name] = wanted[name]
        elif ours:
            del os.environ[name], _derived[name]
    _register_bounded_filesystem()


_registered = False


def _register_bounded_filesystem() -> None:
    global _registered
    if _registered:
        return
    import fsspec  # noqa: PLC0415 (only remote paths need it)

    cls = bounded_gcs_filesystem()
    if cls is not None:
        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, cls, clobber=True)
    _registered = True


# --- bounded operations --------------------------------------------------------------------------------------

def _retryable(error: BaseException) -> bool:
    """A failure that another attempt may not repeat: no connection, a timeout, a server error or throttling;
    not a missing object, a refused permission or a bad request."""
    import aiohttp  # noqa: PLC0415
    from gcsfs.retry import HttpError, is_retriable  # noqa: PLC0415

    if isinstance(error, (FileNotFoundError, FileExistsError, PermissionError, ValueError)):
        return False
    if isinstance(error, HttpError):
        return is_retriable(error)
    return isinstance(error, (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionError)) or \
        is_retriable(error)


async def bounded(operation: str, path: str, attempt: Callable, size: int = 0):
    """`await attempt()` retried on transient failures with exponential backoff, at most SETTINGS.retries
    times, all within SETTINGS.deadline_seconds (plus the time for `size` bytes); else StorageOutage."""
    deadline = time.monotonic() + SETTINGS.deadline_seconds + size / SLOWEST_BYTES_PER_SECOND
    for retry in itertools.count():
        remaining = deadline - time.monotonic()
        try:
            return await asyncio.wait_for(attempt(), max(remaining, 0.001))
        except asyncio.TimeoutError:
            raise StorageOutage(operation, path, f"not done within {SETTINGS.deadline_seconds:g} s, retries "
                                                 f"included") from None
        except Exception as error:  # noqa: BLE001 - sorted by _retryable
            if not _retryable(error):
                raise
            backoff = min(_BACKOFF_FIRST * 2 ** retry, _BACKOFF_MAX)
            if retry >= SETTINGS.retries or time.monotonic() + backoff >= deadline:
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise StorageOutage(operation, path, f"{retry + 1} attempts: {reason}") from error
            log.debug("%s %s failed (%s); retrying in %.0f s", operation, path, error, backoff)
            await asyncio.sleep(backoff)


def bounded_gcs_filesystem():
    """gcsfs's filesystem with every HTTP call bounded (`bounded`); None without gcsfs."""
    gcsfs_log = logging.getLogger("gcsfs")
    if gcsfs_log.level == logging.NOTSET:  # unless the user set it: what gcsfs logs (an announcement at its import,
        gcsfs_log.setLevel(logging.CRITICAL)  # a trace when its own retries run out) is ours to say, in one line
    try:
        # The core class, not gcsfs.GCSFileSystem: that one (ExtendedGcsFileSystem) first asks a gRPC control
        # plane for each bucket's layout, a second client that takes neither the endpoint nor the bounds. The
        # core class speaks the JSON API alone, as TensorStore does.
        from gcsfs.core import GCSFileSystem  # noqa: PLC0415
    except ImportError:
        return None

    class BoundedGCSFileSystem(GCSFileSystem):
        async def _call(self, method, path, *args, **kwargs):
            return await bounded(method, _object_url(self._format_path(path, args), kwargs),
                                 lambda: super(BoundedGCSFileSystem, self)._call(method, path, *args, **kwargs))

        async def _get_file(self, rpath, lpath, **kwargs):
            size = (await self._info(rpath)).get("size") or 0
            return await bounded("download", f"gs://{rpath}", lambda: super(BoundedGCSFileSystem, self)._get_file(
                rpath, lpath, **kwargs), size=int(size))

    BoundedGCSFileSystem.__name__ = BoundedGCSFileSystem.__qualname__ = "BoundedGCSFileSystem"
    return BoundedGCSFileSystem


def _object_url(url: str, kwargs: dict) -> str:
    """gs://bucket/name of the object (or listing prefix) a JSON API request is about, else its URL: the name is
    in the URL's path or query, the listing's prefix, or the metadata at the start of a simple upload's body."""
    match = re.search(r"/b/([^/?]+)/o(?:/([^?]+))?(?:\?(.*))?$", url)
    if not match:
        return url
    name = unquote(match[2] or "") or parse_qs(match[3] or "").get("name", [""])[0] or kwargs.get("prefix") or ""
    data = kwargs.get("data")
    if not name and isinstance(data, (bytes, bytearray, memoryview)):
        named = re.search(rb'"name": "([^"]*)"', bytes(data[:4096]))
        name = named[1].decode() if named else ""
    return f"gs://{unquote(match[1])}/{name}"


class Deadline:
    """A watchdog for work that cannot be interrupted (TensorStore's threads, a stuck upload, a stop's grace
    budget, runtime/stop.py): while an entry is open and its time passes, `report_and_exit(message(), code)` ends
    the process. One daemon thread serves all entries. The lock is reentrant because a signal handler may open
    an entry while the main thread, which it interrupted, holds it."""

    _lock = threading.RLock()
    _open: dict[int, tuple[float, Callable[[], str], int]] = {}
    _ids = itertools.count()
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, seconds: float, message: Callable[[], str], code: int) -> int:
        with cls._lock:
            key = next(cls._ids)
            cls._open[key] = (time.monotonic() + seconds, message, code)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._watch, name="deadline", daemon=True)
                cls._thread.start()
        return key

    @classmethod
    def end(cls, key: int) -> None:
        with cls._lock:
            cls._open.pop(key, None)

    @classmethod
    def _watch(cls) -> None:
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with cls._lock:
                due = [entry for entry in cls._open.values() if entry[0] <= now]
            if due:
                _, message, code = min(due, key=lambda entry: entry[0])
                report_and_exit(message(), code)


@contextlib.contextmanager
def deadline(operation: str, path: str, size: int = 0) -> Iterator[None]:
    """While active, `operation` on `path` must finish within SETTINGS.deadline_seconds (plus the time for
    `size` bytes), else the process ends with the storage outage's line and exit code."""
    seconds = SETTINGS.deadline_seconds + size / SLOWEST_BYTES_PER_SECOND
    message = _outage_message(operation, path, f"not finished within {seconds:g} s")
    key = Deadline.start(seconds, lambda: message, EXIT_STORAGE_OUTAGE)
    try:
        yield
    finally:
        Deadline.end(key)
