"""JSONL sources: one record per line, indexed by byte offset so records are read one at a time.

A share of a file (`JsonlSource.share(lo, hi)`) indexes only the records whose first byte lies in [lo, hi): a
host that trains on a few rows of the global batch reads and indexes only those rows' shares of the file
(data/loader.py), never the whole file. Memory holds ~20 bytes per indexed record (byte offset, line), never
the text, so files larger than memory stream. Blank lines are not records and are skipped (a trailing newline is
common). The index pass can validate every record up front, so a bad line fails the run at start-up rather than
hours in. A gzip or zstd file (`.gz`, `.zst`) cannot be seeked, so it is first decompressed into a temporary file
of this process (every host decompresses the whole file; its share is then read as above). A file at a URL (an
object in a gs:// bucket) is read through its fsspec filesystem: each share's bytes are fetched once, in one
ranged read, into a local file (`_fetch_range`), never a request per record.
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
from dflash_jax.runtime.errors import DataError

COMPRESSED = (".gz", ".zst")
_PROGRESS_EVERY_BYTES = 1 << 20
_COUNT_CHUNK_BYTES = 1 << 20
_COPY_CHUNK_BYTES = 1 << 24


class JsonlSource:
    """A JSONL file (optionally compressed); its size in bytes (decompressed) is what shares are ranges of."""

    unit = "bytes"

    def __init__(self, path: str, fs=None):
        self.name, self.fs = path, fs  # fs: the fsspec filesystem of a URL (gs://...), None for a local path
        self._temporary: tempfile.TemporaryDirectory | None = None
        self._path = None if path.endswith(COMPRESSED) else path  # decompressed when first needed

    @property
    def path(self) -> str:
        """The file to read: the source itself, or its decompressed copy."""
        if self._path is None:
            self._path = self._decompress(self.name)
        return self._path

    @property
    def units(self) -> int:
        if self.fs is not None and self._path == self.name:
            return self.fs.size(self.name)
        return os.path.getsize(self.path)

    def _open(self):
        """The source file as a binary stream (local or through its filesystem)."""
        return open(self.name, "rb") if self.fs is None else self.fs.open(self.name, "rb")

    def _scratch(self, name: str) -> str:
        if self._temporary is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="dflash_jax-")
        return os.path.join(self._temporary.name, name)

    def _decompress(self, path: str) -> str:
        target = self._scratch("records.jsonl")
        errors: tuple[type[Exception], ...] = (OSError, EOFError)  # a truncated or corrupt stream
        if path.endswith(".gz"):
            def opener():
                return gzip.open(self._open(), "rb")
        else:
            import zstandard  # noqa: PLC0415 (needed only for .zst files)

            errors += (zstandard.ZstdError,)

            def opener():
                return zstandard.ZstdDecompressor().stream_reader(self._open(), closefd=True)
        try:
            with opener() as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, _COPY_CHUNK_BYTES)
        except errors as e:
            raise DataError(path, f"cannot decompress: {e}") from None
        return target

    def share(self, lo: int, hi: int, validate: bool, report_bad: Callable[[DataError], None],
              progress: tqdm) -> JsonlShare:
        path = self.path
        if self.fs is not None and path == self.name:  # an object in a bucket: fetch the share's bytes once
            path = self._fetch_range(lo, hi)
        return JsonlShare(self, path, lo, hi, validate, report_bad, progress)

    def _fetch_range(self, lo: int, hi: int) -> str:
        """The bytes the share reads (from lo - 1 through the end of the line holding byte hi - 1), written at
        their own offsets into a sparse local file, so the share reads it as it would the whole file: one
        ranged request per share instead of one per record (a round trip each on an object store)."""
        target = self._scratch(f"share-{lo}-{hi}.jsonl")
        start, size = max(lo - 1, 0), self.units
        with open(target, "wb") as out, self.fs.open(self.name, "rb", block_size=_COPY_CHUNK_BYTES) as source:
            out.seek(start)
            source.seek(start)
            out.write(source.read(max(hi - start, 0)))
            while hi < size:  # complete the line that runs past hi
                chunk = source.read(_PROGRESS_EVERY_BYTES)
                if not chunk:
                    break
                newline = chunk.find(b"\n")
                out.write(chunk if newline < 0 else chunk[: newline + 1])
                if newline >= 0:
                    break
        return target

    def count_newlines(self, stop: int) -> int:
        """Newlines in the first `stop` bytes of the source (only for the line number of a message)."""
        with (open(self.path, "rb") if self.fs is None or self._path != self.name else self._open()) as f:
            return _count_newlines(f, stop)


class JsonlShare:
    """Record i = the line starting at byte `offsets[i]` of the source file."""

    def __init__(self, source: JsonlSource, path: str, lo: int, hi: int, validate: bool,
                 report_bad: Callable[[DataError], None], progress: tqdm):
        """path: the local file holding the source's bytes (at least those of [lo, hi) and their lines)."""
        self.source, self.path, self.first_chat_record = source, path, None
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
        with open(self.path, "rb") as f:
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
            self._line_base = 1 + self.source.count_newlines(self._first_indexed)
        return f"{self.source.name}:{self._line_base + line_index}"

    def read(self, index: int) -> Record:
        """Read and parse record `index` from disk (one seek + one line)."""
        if self._file is None:
            self._file = open(self.path, "rb")
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


def _count_newlines(f: BinaryIO, stop: int) -> int:
    """Newlines in the first `stop` bytes of `f`."""
    count = 0
    while stop > 0:
        chunk = f.read(min(stop, _COUNT_CHUNK_BYTES))
        if not chunk:
            break
        count += chunk.count(b"\n")
        stop -= len(chunk)
    return count
