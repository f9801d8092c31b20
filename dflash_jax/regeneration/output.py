"""The output JSONL of `regenerate`, appended one batch at a time so that a stopped job resumes exactly.

Next to OUT.jsonl, OUT.jsonl.progress.json records after every batch how many input records are done and
how many bytes of OUT.jsonl hold their output (written to a temporary file and renamed over the old one, so
it is always whole). A batch's lines go out in one write; only then is the progress file updated. A rerun
first cuts OUT.jsonl back to the recorded length, dropping whatever a kill left after it (a batch whose
progress was never recorded, or part of a line), and continues with the next input record: every record
is written exactly once, and no line is ever torn once the rerun has begun. The progress file also holds
the settings the output was made with; a rerun with other settings is refused rather than mixing outputs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash_jax.errors import DataError

PROGRESS_SUFFIX = ".progress.json"


class ResumableJsonl:
    """OUT.jsonl plus its progress file. `records_done` input records are already accounted for."""

    def __init__(self, path: str | os.PathLike, settings: dict[str, Any]):
        self.path = Path(path)
        self.progress_path = self.path.with_name(self.path.name + PROGRESS_SUFFIX)
        self.settings = json.loads(json.dumps(settings))  # as it reads back from the file
        self.records_done, self.lines, self.bytes = 0, 0, 0
        if self.progress_path.is_file() and self.path.is_file():
            self._resume()
        elif self.path.exists():
            raise DataError(str(self.path), f"exists, but without {self.progress_path.name} it was not written by "
                                            f"regenerate and cannot be resumed; choose another --out or remove it")
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _resume(self) -> None:
        try:
            saved = json.loads(self.progress_path.read_text())
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
        if self.path.stat().st_size < self.bytes:
            raise DataError(str(self.path), f"is shorter ({self.path.stat().st_size} bytes) than its progress "
                                            f"file records ({self.bytes}); it was changed by something else")
        os.truncate(self.path, self.bytes)

    def append(self, records: list[dict[str, Any] | None], records_consumed: int) -> None:
        """Write `records` (one line each), then record that `records_consumed` more inputs are done."""
        self.append_lines([json.dumps(r, ensure_ascii=False) + "\n" for r in records], records_consumed)

    def append_lines(self, lines: list[str], records_consumed: int) -> None:
        """`append` of lines already encoded, each ending in a newline."""
        data = "".join(lines).encode()
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:  # one write unless the OS takes less
                view = view[os.pwrite(descriptor, view, self.bytes + len(data) - len(view)):]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        self.records_done += records_consumed
        self.lines += len(lines)
        self.bytes += len(data)
        progress = {"settings": self.settings, "records_done": self.records_done, "lines": self.lines,
                    "bytes": self.bytes}
        partial = self.progress_path.with_name(self.progress_path.name + ".tmp")
        partial.write_text(json.dumps(progress, indent=2) + "\n")
        os.replace(partial, self.progress_path)
