"""A training workdir's own bookkeeping, besides the checkpoints (design §7):

    lock.json               held by the run training in it (process 0), so that a second trainer is refused
    config_history.jsonl    the resolved config of every start (time, step), appended, never rewritten
    metrics.jsonl           one record per logged step; on resume the steps after the checkpoint are dropped;
                            appended locally, rewritten whole on an object store (`MetricsLog`)
    errors.log              the full traces behind one-line messages (e.g. an unreadable checkpoint)

Paths are `etils.epath.Path`s, as Orbax's are, so a workdir may be local or a bucket (gs://...).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import types
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from etils import epath
from ml_collections import ConfigDict

from dflash_jax.runtime.errors import CheckpointError, WorkdirLockedError
from dflash_jax.runtime.paths import StagedFile, filesystem, is_url, local_space
from dflash_jax.runtime import storage
from dflash_jax.runtime.storage import StorageOutage
from dflash_jax.runtime import distributed

log = logging.getLogger(__name__)

LOCK_FILE, CONFIG_HISTORY, METRICS_FILE, ERRORS_LOG = ("lock.json", "config_history.jsonl", "metrics.jsonl",
                                                         "errors.log")
# The lock holder rewrites its heartbeat every HEARTBEAT_SECONDS; a lock whose heartbeat is older than
# STALE_AFTER_SECONDS belongs to a run that is gone (killed on another host). On the holder's own host a dead
# process id says so at once.
HEARTBEAT_SECONDS, STALE_AFTER_SECONDS = 60, 300
# The loggers through which Orbax and TensorStore's asyncio machinery report a failed read, each with a trace.
_LIBRARY_LOGGERS = ("absl", "asyncio")


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextlib.contextmanager
def library_logs_captured() -> Iterator[list[str]]:
    """While active, what Orbax (through absl) and asyncio log goes into the yielded list instead of the
    console, to be kept in the error log if the operation fails (`record_error`). So do the traces Python
    prints for a failed read's abandoned TensorStore coroutines when they are collected, which happens here,
    at the end, rather than at some later moment on the console."""
    lines: list[str] = []
    handler = _Collect(lines)
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    propagate = [logger.propagate for logger in loggers]
    unraisable_hook = sys.unraisablehook
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    sys.unraisablehook = lambda unraisable: lines.append(
        f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}\n"
        + "".join(traceback.format_exception(unraisable.exc_value)))
    try:
        yield lines
    finally:
        with warnings.catch_warnings(record=True) as collected:  # "coroutine ... was never awaited", the same reads
            warnings.simplefilter("always")
            _wait_for_abandoned_reads()
            gc.collect()
        lines.extend(str(warning.message) for warning in collected)
        sys.unraisablehook = unraisable_hook
        for logger, previous in zip(loggers, propagate):
            logger.removeHandler(handler)
            logger.propagate = previous


def _wait_for_abandoned_reads(timeout: float = 10.0) -> None:
    """A failed Orbax restore returns while TensorStore still reads the other arrays; their coroutines stay
    alive until those reads complete (on TensorStore's threads) and only then fail on the closed event loop and
    get collected. Waiting for that here (local reads take milliseconds) keeps their traces in this capture
    instead of on the console later.

    The cause is not ours to close: Orbax runs a restore on an event loop of its own and closes that loop without
    cancelling the tasks a failed gather leaves pending (orbax.checkpoint's asyncio_utils, which avoids
    asyncio.run's cancellation on purpose, as not thread-safe); no reference to those tasks or their loop
    reaches the caller, so the abandoned coroutines can only be found among all objects, as here."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
            type(obj) is types.CoroutineType and "orbax" in obj.cr_code.co_filename for obj in gc.get_objects()):
        gc.collect()
        time.sleep(0.01)


def short_reason(error: BaseException, limit: int = 300) -> str:
    """The first line of the innermost cause of `error` (TensorStore's own words, not Orbax's wrapper)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def record_error(workdir: epath.Path, what: str, error: BaseException, library_lines: list[str] = ()) -> str:
    """Appends `what`, the full trace of `error` and the captured library log lines to <workdir>/errors.log;
    returns a clause for the one-line message saying where they are (empty if the log cannot be written,
    e.g. a read-only workdir)."""
    path = workdir / ERRORS_LOG
    entry = "".join([f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {what}\n",
                     *traceback.format_exception(error), *(line + "\n" for line in library_lines)])
    try:
        previous = path.read_text() if path.exists() else ""
        path.write_text(previous + entry)  # append (object stores have no append mode)
    except OSError as write_error:
        log.debug("could not write %s: %s", path, write_error)
        return ""
    return f"; full trace in {path}"


def scheduler_job() -> dict[str, Any] | None:
    """The Slurm job this process runs in, {"id", "run"} (run: how often the job was requeued before), or None.
    A requeued job keeps its id and counts up its runs, and Slurm runs one run of a job at a time: a lock
    held by an earlier run of our job belongs to a run that is gone, on whichever host it ran."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    return {"id": job, "run": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}


class WorkdirLock:
    """Exclusive use of a workdir by one training run: <workdir>/lock.json names the holder (host, pid, start,
    heartbeat, scheduler job). `acquire` refuses a live holder with one line and takes over a stale lock or
    one of an earlier run of this scheduler job (warning); `release` removes the file. A background thread
    refreshes the heartbeat while held."""

    def __init__(self, workdir: epath.Path):
        self.path = workdir / LOCK_FILE
        self._holder = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                        "started": time.time(), "job": scheduler_job()}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        for _ in range(2):  # a stale lock is removed, then the file is created once more
            generation, holder = self._read_generation()
            if holder is not None:
                gone = _why_gone(holder)
                if gone is None:
                    raise WorkdirLockedError(
                        f"{self.path.parent}: another trainer is running in this workdir (host {holder.get('host')}, "
                        f"pid {holder.get('pid')}, started {_when(holder.get('started'))}); stop it first, or "
                        f"delete {self.path} if it is gone")
                log.warning("taking over %s from a run that is gone (%s)", self.path, gone)
                self._remove(generation)
            if self._create():
                self._heartbeat = threading.Thread(target=self._beat, name="workdir-lock", daemon=True)
                self._heartbeat.start()
                return
        raise WorkdirLockedError(f"{self.path}: could not be created; another trainer may be starting here")

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            holder = self._read()
            if holder is not None and holder.get("token") == self._holder["token"]:
                self.path.unlink(missing_ok=True)

    def _text(self) -> str:
        return json.dumps(self._holder | {"heartbeat": time.time()}) + "\n"

    def _create(self) -> bool:
        """Creates the lock file only if there is none, atomically: O_EXCL on a local filesystem; on an object
        store a write conditioned on the object not existing (GCS's ifGenerationMatch=0), which the store
        refuses to every writer but one, however close together or far apart their writes land."""
        if not is_url(self.path):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(descriptor, "w") as file:
                file.write(self._text())
            return True
        fs, name = filesystem(os.fspath(self.path))
        try:
            fs.pipe_file(name, self._text().encode(), mode="create")
        except FileExistsError:  # another's, or ours: a retried create whose first attempt was stored
            holder = self._read()
            return holder is not None and holder.get("token") == self._holder["token"]
        return True

    def _read_generation(self) -> tuple[int | None, dict[str, Any] | None]:
        """(the lock object's generation on an object store, else None; the holder's record as `_read`). The
        generation is read first: a record read after it is of that generation or a newer one, so that a
        removal conditioned on it never removes a record that was not judged."""
        if not is_url(self.path):
            return None, self._read()
        fs, name = filesystem(os.fspath(self.path))
        bucket, key, _ = fs.split_path(name)
        try:
            generation = int(fs.call("GET", "b/{}/o/{}", bucket, key, json_out=True)["generation"])
        except FileNotFoundError:
            return None, None
        return generation, self._read()

    def _remove(self, generation: int | None) -> None:
        """Removes the stale lock; on an object store only if it is still the generation judged stale, so that
        of two trainers taking over at once, the second cannot remove the lock the first has just created. A local
        file has no generation to condition the removal on: two takeovers on one local disk in the same moment
        may both succeed."""
        if generation is None:
            self.path.unlink(missing_ok=True)
            return
        fs, name = filesystem(os.fspath(self.path))
        bucket, key, _ = fs.split_path(name)
        with contextlib.suppress(FileNotFoundError, FileExistsError):  # FileExistsError: the precondition failed
            fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=str(generation))
        fs.invalidate_cache(name)

    def _read(self) -> dict[str, Any] | None:
        """The holder's record; None without a lock file, {} for one that cannot be parsed."""
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            return {}

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            partial = self.path.parent / (LOCK_FILE + ".tmp")
            try:
                partial.write_text(self._text())
                partial.replace(self.path)
            except StorageOutage as error:  # a missed heartbeat: the lock goes stale only after several
                error.forgive()
                log.warning("%s", error)


def _why_gone(holder: dict[str, Any]) -> str | None:
    """Why the lock's holder is no longer running, or None if it may be."""
    if "heartbeat" not in holder:  # heartbeats replace the file atomically: this one was torn by a crash
        return "the lock file is unreadable"
    age = time.time() - float(holder.get("heartbeat", 0))
    if age > STALE_AFTER_SECONDS:
        return f"host {holder.get('host')}, pid {holder.get('pid')}: no heartbeat for {age:.0f} s"
    job, theirs = scheduler_job(), holder.get("job") or {}
    if job is not None and theirs.get("id") == job["id"] and theirs.get("run", 0) < job["run"]:
        return (f"host {holder.get('host')}, pid {holder.get('pid')}: run {theirs.get('run', 0)} of Slurm job "
                f"{job['id']}, which is now in run {job['run']}")
    if holder.get("host") == socket.gethostname():
        pid = int(holder.get("pid", -1))
        if pid == os.getpid() or not _process_alive(pid):  # our own pid: a previous life of this container
            return f"process {pid} on this host is not running"
    return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    try:  # a killed child its parent has not reaped yet is a zombie: gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _when(timestamp: float | None) -> str:
    return "at an unknown time" if timestamp is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                                                        time.localtime(timestamp))


@contextlib.contextmanager
def workdir_held(workdir: epath.Path) -> Iterator[None]:
    """Holds the workdir's lock for the run (process 0 takes it; with several processes all of them learn
    whether it did, so that all stop with the same error)."""
    lock = WorkdirLock(workdir) if jax.process_index() == 0 else None
    refused: WorkdirLockedError | None = None
    if lock is not None:
        try:
            lock.acquire()
        except WorkdirLockedError as error:
            refused = error
    if distributed.process_flags(refused is not None)[0]:
        refused = refused or WorkdirLockedError(f"{workdir}: another trainer holds this workdir (see process 0)")
    if refused is not None:
        raise refused
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def append_config_history(workdir: epath.Path, config: ConfigDict, step: int) -> None:
    """One line per accepted start: when, from which step, with which resolved config."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "start_step": step,
             "config": json.loads(config.to_json_best_effort())}
    path = workdir / CONFIG_HISTORY
    previous = path.read_text() if path.exists() else ""
    path.write_text(previous + json.dumps(entry, sort_keys=True) + "\n")


def config_of_step(workdir: epath.Path, step: int) -> dict[str, Any] | None:
    """The config of the run that wrote checkpoint `step`: the last start before it (None: no history)."""
    path = workdir / CONFIG_HISTORY
    if not path.exists():
        return None
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    before = [entry for entry in entries if entry["start_step"] < step]
    return (before or entries)[-1]["config"] if entries else None


def drop_metrics_after(workdir: epath.Path, step: int) -> None:
    """Removes metrics.jsonl records of steps after `step` (logged after the checkpoint a resume restarts
    from; the resumed run logs them again), so that every step appears once."""
    path = workdir / METRICS_FILE
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
    if len(kept) != len(lines):
        partial = workdir / (METRICS_FILE + ".tmp")
        partial.write_text("".join(kept))
        partial.replace(path)


class MetricsLog:
    """metrics.jsonl as the run writes it, one record at a time, each on the store when `write` returns.

    On a local disk the file is appended to and flushed per record. In a bucket it is a `StagedFile` (no append
    on object stores): appended to locally, and the whole file, the records so far and the new one, uploaded at
    each record, so that neither a resume nor a kill loses records (design §7.1)."""

    def __init__(self, workdir: epath.Path):
        self.path = workdir / METRICS_FILE
        self._staged = StagedFile(os.fspath(self.path)) if is_url(self.path) else None
        self._space = self._staged.space if self._staged else lambda: local_space(workdir, METRICS_FILE)
        with self._space():
            self._file = (self._staged.local if self._staged else self.path).open("a")

    def write(self, record: dict[str, Any]) -> None:
        with self._space():  # a record that does not fit is never uploaded: the store keeps the ones before
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._staged:
            self._staged.upload()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a record that did not fit: reported by `write` already
            self._file.close()


def read_metrics(workdir: epath.Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records, without a last line torn by a kill in mid-write."""
    path = workdir / METRICS_FILE
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line) for line in lines if _step_of(line) is not None]


def _step_of(line: str) -> int | None:
    """The step of a metrics record; None for a line torn by a kill in mid-write."""
    if not line.endswith("\n"):
        return None
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def newest_readable(checkpoints: epath.Path, steps: Sequence[int], restore: Callable[[int], Any]
                    ) -> tuple[int, Any, list[int]]:
    """Tries `restore(step)` from the newest of `steps` back: (step, what it returned, the newer steps that
    failed). Each failure's full trace (and what Orbax and TensorStore logged) goes to the workdir's errors.log
    (in the parent of `checkpoints`), not the console; once a step is read, each newer failure is one warning line
    naming the step and why. If none can be read: one CheckpointError. A store that does not answer is a
    StorageOutage, never a failed step, and a restore from a bucket is bounded by the storage deadline."""
    workdir = checkpoints.parent
    failures: dict[int, str] = {}
    for step in sorted(steps, reverse=True):
        where = f"{checkpoints}/{step}"
        # In a bucket, TensorStore's threads read it: bounded by the storage watchdog (design §7.2).
        bounded = storage.deadline("checkpoint restore", where) if is_url(checkpoints) else contextlib.nullcontext()
        with library_logs_captured() as library_lines, bounded:
            try:
                result = restore(step)
            except Exception as error:  # noqa: BLE001 - any failure to read means: fall back to an older step
                outage = storage.outage_in(error, "checkpoint restore", where)
                if outage is error:  # the store did not answer: says nothing about the checkpoint
                    raise
                if outage is not None:
                    raise outage from error
                failures[step] = short_reason(error) + record_error(
                    workdir, f"restoring checkpoint step {step}", error, library_lines)
                continue
        for bad, reason in failures.items():
            log.warning("checkpoint step %d in %s is unreadable (%s); using step %d instead", bad,
                        checkpoints, reason, step)
        return step, result, list(failures)
    if len(failures) == 1:
        (step, reason), = failures.items()
        raise CheckpointError(f"{checkpoints}: checkpoint step {step} is unreadable ({reason})")
    raise CheckpointError(f"{checkpoints}: no checkpoint is readable (steps {', '.join(map(str, sorted(steps)))}); "
                          f"the oldest, step {min(steps)}, failed with: {failures[min(steps)]}")
