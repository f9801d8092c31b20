"""Table sources: a Parquet file or a Hugging Face dataset, one record per row, read with pyarrow / `datasets`.

Shares are ranges of rows (a JSONL file's are ranges of bytes, data/jsonl.py). A Parquet share reads only the
row groups that hold its rows and keeps them in a memory-mapped Arrow file of this process, so records are read
one at a time in shuffled order without decoding a row group per record and without holding the text in memory.
A Hugging Face dataset (a `save_to_disk` directory, or a dataset id resolved by `datasets` from the local cache)
is memory-mapped Arrow already: a share reads only its own rows' pages. Rows are records as in data/records.py;
a table gives every row every column and every struct every field of the column's type, so nulls are dropped at
every depth (a tool call's arguments hold only the arguments given). Messages name rows `path row N` (from 0).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dflash_jax.data.records import ChatRecord, Record, parse_object
from dflash_jax.runtime.errors import DataError

_VALIDATE_BATCH_ROWS = 1024


class ParquetSource:
    unit = "rows"

    def __init__(self, path: str, fs=None):
        """fs: the fsspec filesystem of a URL; row groups are then read with ranged requests."""
        import pyarrow.parquet as pq  # noqa: PLC0415 (pyarrow is needed only for table sources)

        self.name = path
        try:
            self._file = pq.ParquetFile(path if fs is None else fs.open(path, "rb"))
        except Exception as e:  # pyarrow.ArrowInvalid and kin: not a Parquet file
            raise DataError(path, f"cannot read as Parquet: {e}") from None
        self.units = self._file.metadata.num_rows

    def share(self, lo: int, hi: int, validate: bool, report_bad: Callable[[DataError], None],
              progress=None) -> TableShare:
        import pyarrow as pa  # noqa: PLC0415

        # The row groups that overlap [lo, hi), cut to it, into an Arrow IPC file that is then memory-mapped.
        directory = tempfile.TemporaryDirectory(prefix="dflash_jax-")
        path = os.path.join(directory.name, "share.arrow")
        metadata, start = self._file.metadata, 0
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, self._file.schema_arrow) as writer:
            for group in range(metadata.num_row_groups):
                rows = metadata.row_group(group).num_rows
                first, last = max(lo, start), min(hi, start + rows)
                if first < last:
                    writer.write_table(self._file.read_row_group(group).slice(first - start, last - first))
                start += rows
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        return TableShare(self.name, table, lo, validate, report_bad, keep=directory)


class DatasetSource:
    """A `datasets.Dataset` (memory-mapped): from `load_from_disk(path)`, or `load_dataset(id, split=...)`."""

    unit = "rows"

    def __init__(self, name: str, dataset: Any):
        self.name, self._dataset = name, dataset.with_format("arrow")
        self.units = len(dataset)

    def share(self, lo: int, hi: int, validate: bool, report_bad: Callable[[DataError], None],
              progress=None) -> TableShare:
        return TableShare(self.name, self._dataset, lo, validate, report_bad, stop=hi)


class TableShare:
    """Rows [first, first + len) of a table; record i = the i-th row of the share that passed validation.

    table: a pyarrow Table holding exactly the share's rows, or (with `stop`) an arrow-formatted `datasets`
    Dataset holding all rows, of which [first, stop) are the share's."""

    def __init__(self, name: str, table: Any, first: int, validate: bool, report_bad: Callable[[DataError], None],
                 stop: int | None = None, keep: Any = None):
        self.name, self._table, self._keep = name, table, keep  # keep: the temporary file's directory
        self._is_dataset = stop is not None
        self._offset = first if self._is_dataset else 0  # the share's first row within `table`
        self.first, self.first_chat_record = first, None
        count = len(table) if stop is None else max(stop - first, 0)
        rows = np.arange(count, dtype=np.int64)
        if validate:
            rows = np.asarray([i for i, row in self._rows(count) if self._accept(i, row, report_bad)], np.int64)
        self.rows = rows

    def _rows(self, count: int) -> Iterator[tuple[int, dict[str, Any]]]:
        for start in range(0, count, _VALIDATE_BATCH_ROWS):
            batch = self._slice(start, min(count, start + _VALIDATE_BATCH_ROWS) - start)
            yield from enumerate(batch.to_pylist(), start)

    def _slice(self, start: int, length: int):
        """Rows [start, start + length) of the share as a pyarrow Table."""
        if self._is_dataset:
            start += self._offset
            return self._table[start:start + length]
        return self._table.slice(start, length)

    def _accept(self, i: int, row: dict[str, Any], report_bad: Callable[[DataError], None]) -> bool:
        try:
            record = parse_object(_without_nulls(row), self._where_row(i))
        except DataError as e:
            report_bad(e)
            return False
        if isinstance(record, ChatRecord) and self.first_chat_record is None:
            self.first_chat_record = self._where_row(i)
        return True

    def __len__(self) -> int:
        return len(self.rows)

    def _where_row(self, i: int) -> str:
        return f"{self.name} row {self.first + i}"

    def where(self, index: int) -> str:
        return self._where_row(int(self.rows[index]))

    location = where  # as cheap as the message

    def read(self, index: int) -> Record:
        i = int(self.rows[index])
        return parse_object(_without_nulls(self._slice(i, 1).to_pylist()[0]), self._where_row(i))

    def close(self) -> None:
        if self._keep is not None:  # the Parquet share's temporary Arrow file
            self._table = None
            self._keep.cleanup()
            self._keep = None


def _without_nulls(value: Any) -> Any:
    """`value` with every null dict entry dropped, at every depth."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value
