"""The output JSONL of `regenerate`, appended one batch at a time so that a stopped job resumes exactly.

Next to OUT.jsonl, OUT.jsonl.progress.json records after every batch how many input records are done and
how many bytes of OUT.jsonl hold their output (written to a temporary file and renamed over the old one, so
it is always whole). A batch's lines go out in one write; only then is the progress file updated. A rerun
first cuts OUT.jsonl back to the recorded length, dropping whatever a kill left after it (a batch whose
progress was never recorded, or part of a line), and continues with the next input record: every record
is written exactly once, and no line is ever torn once the rerun has begun. The progress file also holds
the settings the output was made with; a rerun with other settings is refused rather than mixing outputs.

OUT at a URL (gs://bucket/train.jsonl; object stores have no append, design §7.1): both files are
`paths.StagedFile`s, written locally as above and uploaded whole, OUT before its progress file, so the
store's progress never counts bytes the store's OUT lacks and a rerun anywhere resumes from the store exactly.
Each upload sends the whole output, so they are spaced out: at least UPLOAD_EVERY_S apart, and far enough
apart that uploading takes at most UPLOAD_SHARE of the job's time as the output grows. A kill loses the
records since the last upload (they are regenerated); `close` uploads the rest.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from dflash_jax.runtime.errors import DataError
from dflash_jax.runtime.paths import StagedFile, as_path, is_url, local_space

PROGRESS_SUFFIX = ".progress.json"
UPLOAD_EVERY_S = 30.0
UPLOAD_SHARE = 0.1


class ResumableJsonl:
    """OUT.jsonl plus its progress file. `records_done` input records are already accounted for."""

    def __init__(self, path: str | os.PathLike, settings: dict[str, Any]):
        self.path = as_path(path)
        self.progress_path = self.path.with_name(self.path.name + PROGRESS_SUFFIX)
        self._staged = [StagedFile(os.fspath(p)) for p in (self.path, self.progress_path)] if is_url(path) else []
        # The files written: the staged copies of a URL's objects, else the local files themselves.
        self._file, self._progress_file = ([s.local for s in self._staged] if self._staged
                                           else [Path(self.path), Path(self.progress_path)])
        self._next_upload, self._unsent = time.monotonic() + UPLOAD_EVERY_S, False
        self.settings = json.loads(json.dumps(settings))  # as it reads back from the file
        self.records_done, self.lines, self.bytes = 0, 0, 0
        if self._progress_file.is_file() and self._file.is_file():
            self._resume()
        elif self._file.exists():
            raise DataError(str(self.path), f"exists, but without {self.progress_path.name} it was not written by "
                                            f"regenerate and cannot be resumed; choose another --out or remove it")
        self._file.parent.mkdir(parents=True, exist_ok=True)

    def _resume(self) -> None:
        try:
            saved = json.loads(self._progress_file.read_text())
            recorded = (saved["settings"], int(saved["records_done"]), int(saved["lines"]), int(saved["bytes"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise DataError(str(self.progress_path), f"unreadable progress file ({error}); remove it and "
                                                     f"{self.path.name} to start over") from None
        settings, self.records_done, self.lines, self.bytes = recorded
        changed = {key: (settings.get(key), value) for key, value in self.settings.items()
                   if settings.get(key) != value}
        if changed:
            raise DataError(str(self.path), f"was generated with other settings ((then, now): {changed}); rerun "
                                            f"with the same ones to resume, or write to another --out")
        if self._file.stat().st_size < self.bytes:
            raise DataError(str(self.path), f"is shorter ({self._file.stat().st_size} bytes) than its progress "
                                            f"file records ({self.bytes}); it was changed by something else")
        os.truncate(self._file, self.bytes)

    def append(self, records: list[dict[str, Any] | None], records_consumed: int) -> None:
        """Write `records` (one line each), then record that `records_consumed` more inputs are done."""
        self.append_lines([json.dumps(r, ensure_ascii=False) + "\n" for r in records], records_consumed)

    def append_lines(self, lines: list[str], records_consumed: int) -> None:
        """`append` of lines already encoded, each ending in a newline."""
        data = "".join(lines).encode()
        # Out of space part-way: the output stays as its progress file records it, locally and in the store.
        space = self._staged[0].space() if self._staged else local_space(self._file.parent, self._file.name)
        with space:
            descriptor = os.open(self._file, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                view = memoryview(data)
                while view:  # one write unless the OS takes less
                    view = view[os.pwrite(descriptor, view, self.bytes + len(data) - len(view)):]
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            progress = {"settings": self.settings, "records_done": self.records_done + records_consumed,
                        "lines": self.lines + len(lines), "bytes": self.bytes + len(data)}
            partial = self._progress_file.with_name(self._progress_file.name + ".tmp")
            partial.write_text(json.dumps(progress, indent=2) + "\n")
            os.replace(partial, self._progress_file)
        self.records_done, self.lines, self.bytes = progress["records_done"], progress["lines"], progress["bytes"]
        self._unsent = bool(self._staged)
        if self._unsent and time.monotonic() >= self._next_upload:
            self._upload()

    def close(self) -> None:
        """Upload what the store lacks of an output at a URL and drop the staged copies (a local output: nothing
        to do)."""
        if self._unsent:
            self._upload()
        for staged in self._staged:
            staged.local.unlink(missing_ok=True)

    def _upload(self) -> None:
        start = time.monotonic()
        for staged in self._staged:  # the output first: the store's progress never runs ahead of it
            staged.upload()
        took = time.monotonic() - start
        self._next_upload, self._unsent = time.monotonic() + max(UPLOAD_EVERY_S, took / UPLOAD_SHARE), False
