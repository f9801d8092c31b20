"""JSONL sources: one record per line, indexed by byte offset so records are read one at a time.

A share of a file (`JsonlSource.share(lo, hi)`) indexes only the records whose first byte lies in [lo, hi): a
host that trains on a few rows of the global batch reads and indexes only those rows' shares of the file
(data/loader.py), never the whole file. Memory holds ~20 bytes per indexed record (byte offset, line), never
the text, so files larger than memory stream. Blank lines are not records and are skipped (a trailing newline is
common). The index pass can validate every record up front, so a bad line fails the run at start-up rather than
hours in. A gzip or zstd file (`.gz`, `.zst`) cannot be seeked, so it is first decompressed into a temporary file
of this process (every host decompresses the whole file; its share is then read as above).
"""

from __future__ import annotations

import array
import gzip
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from dflash_jax.data.records import ChatRecord, Record, parse_record
from dflash_jax.errors import DataError

COMPRESSED = (".gz", ".zst")
_PROGRESS_EVERY_BYTES = 1 << 20
_COUNT_CHUNK_BYTES = 1 << 20
_COPY_CHUNK_BYTES = 1 << 24


class JsonlSource:
    """A JSONL file (optionally compressed); its size in bytes (decompressed) is what shares are ranges of."""

    unit = "bytes"

    def __init__(self, path: str):
        self.name = path
        self._decompressed: tempfile.TemporaryDirectory | None = None
        self._path = None if path.endswith(COMPRESSED) else path  # decompressed when first needed

    @property
    def path(self) -> str:
        """The file to read: the source itself, or its decompressed copy."""
        if self._path is None:
            self._path = self._decompress(self.name)
        return self._path

    @property
    def units(self) -> int:
        return os.path.getsize(self.path)

    def _decompress(self, path: str) -> str:
        self._decompressed = tempfile.TemporaryDirectory(prefix="dflash_jax-")
        target = os.path.join(self._decompressed.name, "records.jsonl")
        errors: tuple[type[Exception], ...] = (OSError, EOFError)  # a truncated or corrupt stream
        if path.endswith(".gz"):
            def opener():
                return gzip.open(path, "rb")
        else:
            import zstandard  # noqa: PLC0415 (needed only for .zst files)

            errors += (zstandard.ZstdError,)

            def opener():
                return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        try:
            with opener() as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, _COPY_CHUNK_BYTES)
        except errors as e:
            raise DataError(path, f"cannot decompress: {e}") from None
        return target

    def share(self, lo: int, hi: int, validate: bool, report_bad: Callable[[DataError], None],
              progress: tqdm) -> JsonlShare:
        return JsonlShare(self, lo, hi, validate, report_bad, progress)


class JsonlShare:
    """Record i = the line starting at byte `offsets[i]` of the source file."""

    def __init__(self, source: JsonlSource, lo: int, hi: int, validate: bool,
                 report_bad: Callable[[DataError], None], progress: tqdm):
        self.source, self.first_chat_record = source, None
        # Line numbers are counted from the first line indexed; where that line is not the file's first, the
        # lines before it are counted only when a message needs one (`where`).
        self._first_indexed, self._line_base = lo, (1 if lo == 0 else None)
        offsets, lines = array.array("q"), array.array("q")
        if lo < hi:
            self._index(lo, hi, validate, report_bad, progress, offsets, lines)
        self.offsets = np.frombuffer(offsets, dtype=np.int64)
        self.lines = np.frombuffer(lines, dtype=np.int64)  # 0 = the first line indexed
        self._file: BinaryIO | None = None

    def _index(self, start: int, stop: int, validate: bool, report_bad: Callable[[DataError], None],
               progress: tqdm, offsets: array.array, lines: array.array) -> None:
        with open(self.source.path, "rb") as f:
            offset = start
            if start > 0:  # the line that holds byte start-1 belongs to the range before this one
                f.seek(start - 1)
                offset = start - 1 + len(f.readline())
            self._first_indexed = offset
            line_index, unreported = 0, 0
            while offset < stop:
                line = f.readline()
                if not line:
                    break
                if line.strip() and self._accept(line, line_index, validate, report_bad):
                    offsets.append(offset)
                    lines.append(line_index)
                offset += len(line)
                line_index += 1
                unreported += len(line)
                if unreported >= _PROGRESS_EVERY_BYTES:
                    progress.update(unreported)
                    unreported = 0
            progress.update(unreported)

    def _accept(self, line: bytes, line_index: int, validate: bool, report_bad: Callable[[DataError], None]) -> bool:
        if not validate:
            return True
        try:
            record = self._parse(line, line_index)
        except DataError as e:
            report_bad(e)
            return False
        if isinstance(record, ChatRecord) and self.first_chat_record is None:
            self.first_chat_record = self._where(line_index)
        return True

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, index: int) -> str:
        """`path:line` of record `index`: for messages about a bad record."""
        return self._where(int(self.lines[index]))

    def location(self, index: int) -> str:
        """`path at byte N` of record `index`, free to compute: for messages that are not errors."""
        return f"{self.source.name} at byte {self.offsets[index]}"

    def _where(self, line_index: int) -> str:
        if self._line_base is None:
            self._line_base = 1 + _count_newlines(self.source.path, self._first_indexed)
        return f"{self.source.name}:{self._line_base + line_index}"

    def read(self, index: int) -> Record:
        """Read and parse record `index` from disk (one seek + one line)."""
        if self._file is None:
            self._file = open(self.source.path, "rb")
        self._file.seek(int(self.offsets[index]))
        return self._parse(self._file.readline(), int(self.lines[index]))

    def _parse(self, line: bytes, line_index: int) -> Record:
        try:
            return parse_record(line, "")
        except DataError as e:  # only now is the record's line number worth counting
            raise DataError(self._where(line_index), e.reason) from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
