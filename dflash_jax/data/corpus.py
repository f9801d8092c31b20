"""A JSONL corpus on disk, indexed by byte offset so records are read one at a time by seek.

Memory holds ~20 bytes per record (file id, byte offset, line number), never the text, so corpora larger
than memory stream. Blank lines are not records and are skipped (a trailing newline is common); every
other line is a record. The index pass can also validate every record's JSON and fields up front, so a bad
line fails the run at start-up rather than hours in.
"""

from __future__ import annotations

import array
import logging
import os
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from dflash_jax.data.records import ChatRecord, Record, parse_record
from dflash_jax.errors import DataError

log = logging.getLogger(__name__)

_PROGRESS_EVERY_BYTES = 1 << 20


class Corpus:
    """Record i of the corpus = line `line_numbers[i]` of `paths[file_ids[i]]`, starting at `offsets[i]`.

    bad_records: "raise" aborts on the first invalid record with `path:line: reason`; "skip" logs that
    message as a warning, counts it in `skipped_records`, and leaves the record out (only meaningful with
    validate=True; records that fail later, at tokenization, are handled by the loader with the same policy).
    """

    def __init__(self, paths: Sequence[str | os.PathLike], validate: bool = True, bad_records: str = "raise"):
        if not paths:
            raise DataError("corpus", "no input files given")
        if bad_records not in ("raise", "skip"):
            raise ValueError(f"bad_records must be 'raise' or 'skip', got {bad_records!r}")
        self.paths = [os.fspath(p) for p in paths]
        self.bad_records = bad_records
        self.skipped_records = 0
        self.first_chat_record: str | None = None  # `path:line` of the first chat record seen by validation
        file_ids, offsets, line_numbers = array.array("i"), array.array("q"), array.array("q")
        with tqdm(total=sum(os.path.getsize(p) for p in self.paths), unit="B", unit_scale=True,
                  desc="indexing corpus") as progress:
            for file_id, path in enumerate(self.paths):
                self._index_file(file_id, path, validate, progress, file_ids, offsets, line_numbers)
        if not offsets:
            raise DataError(", ".join(self.paths), "corpus has no records")
        self.file_ids = np.frombuffer(file_ids, dtype=np.int32)
        self.offsets = np.frombuffer(offsets, dtype=np.int64)
        self.line_numbers = np.frombuffer(line_numbers, dtype=np.int64)
        self._files: dict[int, BinaryIO] = {}

    def _index_file(self, file_id: int, path: str, validate: bool, progress: tqdm,
                    file_ids: array.array, offsets: array.array, line_numbers: array.array) -> None:
        offset, unreported = 0, 0
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, start=1):
                if line.strip() and self._accept(line, f"{path}:{line_number}", validate):
                    file_ids.append(file_id)
                    offsets.append(offset)
                    line_numbers.append(line_number)
                offset += len(line)
                unreported += len(line)
                if unreported >= _PROGRESS_EVERY_BYTES:
                    progress.update(unreported)
                    unreported = 0
        progress.update(unreported)

    def _accept(self, line: bytes, where: str, validate: bool) -> bool:
        if not validate:
            return True
        try:
            record = parse_record(line, where)
        except DataError as e:
            self.report_bad_record(e)
            return False
        if isinstance(record, ChatRecord) and self.first_chat_record is None:
            self.first_chat_record = where
        return True

    def report_bad_record(self, error: DataError) -> None:
        """Apply the bad-record policy: re-raise, or log and count."""
        if self.bad_records == "raise":
            raise error
        self.skipped_records += 1
        log.warning("skipping bad record: %s", error)

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, index: int) -> str:
        return f"{self.paths[self.file_ids[index]]}:{self.line_numbers[index]}"

    def read(self, index: int) -> Record:
        """Read and parse record `index` from disk (one seek + one line)."""
        file_id = int(self.file_ids[index])
        if file_id not in self._files:
            self._files[file_id] = open(self.paths[file_id], "rb")
        f = self._files[file_id]
        f.seek(int(self.offsets[index]))
        return parse_record(f.readline(), self.where(index))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
