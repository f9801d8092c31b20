"""A JSONL corpus on disk, or one byte range of it, indexed by byte offset so records are read one at a time.

The corpus is the concatenation of its files. `Corpus(paths, byte_range=(lo, hi))` indexes only the records
whose first byte lies in [lo, hi): a host that trains on a few rows of the global batch reads and indexes
only the shares of those rows (data/loader.py), never the whole corpus. Memory holds ~20 bytes per indexed
record (file id, byte offset, line), never the text, so corpora larger than memory stream. Blank lines are
not records and are skipped (a trailing newline is common); every other line is a record. The index pass can
also validate every record's JSON and fields up front, so a bad line fails the run at start-up rather than
hours in.
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
_COUNT_CHUNK_BYTES = 1 << 20


def check_input_files(paths: Sequence[str | os.PathLike], what: str) -> None:
    """DataError naming the path and `what` (the flag or config field) for a path that is missing, a
    directory or unreadable: checked at start-up, before anything is loaded."""
    for path in paths:
        if not os.path.exists(path):
            raise DataError(os.fspath(path), f"no such file ({what})")
        if os.path.isdir(path):
            raise DataError(os.fspath(path), f"is a directory, not a JSONL file ({what})")
        if not os.access(path, os.R_OK):
            raise DataError(os.fspath(path), f"not readable by this user ({what})")


def corpus_bytes(paths: Sequence[str | os.PathLike]) -> int:
    """Size of the concatenated files: what byte ranges of the corpus are ranges of."""
    return sum(os.path.getsize(path) for path in paths)


class Corpus:
    """Record i = the line starting at byte `offsets[i]` of `paths[file_ids[i]]`.

    byte_range: (lo, hi) of the concatenated files (which may hold no record); None = all of them.
    bad_records: "raise" aborts on the first invalid record with `path:line: reason`; "skip" logs that
    message as a warning, counts it in `skipped_records`, and leaves the record out (only meaningful with
    validate=True; records that fail later, at tokenization, are handled by the loader with the same policy).
    progress: a shared progress bar (bytes) for several corpora indexed one after another.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], byte_range: tuple[int, int] | None = None,
                 validate: bool = True, bad_records: str = "raise", progress: tqdm | None = None):
        if not paths:
            raise DataError("corpus", "no input files given")
        if bad_records not in ("raise", "skip"):
            raise ValueError(f"bad_records must be 'raise' or 'skip', got {bad_records!r}")
        self.paths = [os.fspath(p) for p in paths]
        self.bad_records = bad_records
        self.skipped_records = 0
        self.first_chat_record: str | None = None  # `path:line` of the first chat record seen by validation
        sizes = [os.path.getsize(path) for path in self.paths]
        lo, hi = byte_range if byte_range is not None else (0, sum(sizes))
        file_ids, offsets, lines = array.array("i"), array.array("q"), array.array("q")
        # Line numbers are counted from the first line indexed in each file; where that line is not the
        # file's first, the lines before it are counted only when a message needs one (`where`).
        self._first_indexed: dict[int, int] = {}  # file id -> byte offset of its first indexed line
        self._line_base: dict[int, int] = {}  # file id -> line number of that line, once counted
        own_bar = progress is None
        progress = progress if progress is not None else tqdm(total=hi - lo, unit="B", unit_scale=True,
                                                             desc="indexing corpus")
        file_start = 0
        for file_id, (path, size) in enumerate(zip(self.paths, sizes)):
            start, stop = max(lo - file_start, 0), min(hi - file_start, size)
            if start < stop:
                self._index_file(file_id, path, start, stop, validate, progress, file_ids, offsets, lines)
            file_start += size
        if own_bar:
            progress.close()
        if not offsets and byte_range is None:
            raise DataError(", ".join(self.paths), "corpus has no records")
        self.file_ids = np.frombuffer(file_ids, dtype=np.int32)
        self.offsets = np.frombuffer(offsets, dtype=np.int64)
        self.lines = np.frombuffer(lines, dtype=np.int64)  # 0 = the first line indexed in that file
        self._files: dict[int, BinaryIO] = {}

    def _index_file(self, file_id: int, path: str, start: int, stop: int, validate: bool, progress: tqdm,
                    file_ids: array.array, offsets: array.array, lines: array.array) -> None:
        """Index the lines of `path` that start in [start, stop)."""
        with open(path, "rb") as f:
            offset = start
            if start > 0:  # the line that holds byte start-1 belongs to the range before this one
                f.seek(start - 1)
                offset = start - 1 + len(f.readline())
            self._first_indexed[file_id] = offset
            if start == 0:
                self._line_base[file_id] = 1
            line_index, unreported = 0, 0
            while offset < stop:
                line = f.readline()
                if not line:
                    break
                if line.strip() and self._accept(line, file_id, line_index, validate):
                    file_ids.append(file_id)
                    offsets.append(offset)
                    lines.append(line_index)
                offset += len(line)
                line_index += 1
                unreported += len(line)
                if unreported >= _PROGRESS_EVERY_BYTES:
                    progress.update(unreported)
                    unreported = 0
            progress.update(unreported)

    def _accept(self, line: bytes, file_id: int, line_index: int, validate: bool) -> bool:
        if not validate:
            return True
        try:
            record = self._parse(line, file_id, line_index)
        except DataError as e:
            self.report_bad_record(e)
            return False
        if isinstance(record, ChatRecord) and self.first_chat_record is None:
            self.first_chat_record = self._where(file_id, line_index)
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
        """`path:line` of record `index`: for messages about a bad record. The first one in a share that
        starts inside a file counts the newlines before the share."""
        return self._where(int(self.file_ids[index]), int(self.lines[index]))

    def byte_location(self, index: int) -> str:
        """`path at byte N` of record `index`, free to compute: for messages that are not errors."""
        return f"{self.paths[self.file_ids[index]]} at byte {self.offsets[index]}"

    def _where(self, file_id: int, line_index: int) -> str:
        if file_id not in self._line_base:
            self._line_base[file_id] = 1 + _count_newlines(self.paths[file_id], self._first_indexed[file_id])
        return f"{self.paths[file_id]}:{self._line_base[file_id] + line_index}"

    def read(self, index: int) -> Record:
        """Read and parse record `index` from disk (one seek + one line)."""
        file_id = int(self.file_ids[index])
        if file_id not in self._files:
            self._files[file_id] = open(self.paths[file_id], "rb")
        f = self._files[file_id]
        f.seek(int(self.offsets[index]))
        return self._parse(f.readline(), file_id, int(self.lines[index]))

    def _parse(self, line: bytes, file_id: int, line_index: int) -> Record:
        try:
            return parse_record(line, "")
        except DataError as e:  # only now is the record's line number worth counting
            raise DataError(self._where(file_id, line_index), e.reason) from None

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _count_newlines(path: str, stop: int) -> int:
    """Newlines in the first `stop` bytes of `path`."""
    count = 0
    with open(path, "rb") as f:
        while stop > 0:
            chunk = f.read(min(stop, _COUNT_CHUNK_BYTES))
            if not chunk:
                break
            count += chunk.count(b"\n")
            stop -= len(chunk)
    return count
