"""Fixtures of the data tests."""

from __future__ import annotations

import gzip

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tests.data_fixtures import mixed_records, write_jsonl


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, str]:
    """The same records as JSONL, gzip and zstd JSONL, Parquet (small row groups) and a save_to_disk dataset."""
    root = tmp_path_factory.mktemp("formats")
    records = mixed_records()
    jsonl = write_jsonl(root / "train.jsonl", records)
    (root / "train.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes()))
    (root / "train.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl.read_bytes()))
    # A table gives every row every column: the fields a record lacks are nulls.
    table = pa.Table.from_pylist([{key: r.get(key) for key in ("messages", "prompt", "completion")} for r in records])
    pq.write_table(table, root / "train.parquet", row_group_size=5)
    datasets.Dataset(table).save_to_disk(str(root / "saved"))
    return {"jsonl": str(jsonl), "gz": f"{jsonl}.gz", "zst": f"{jsonl}.zst", "parquet": str(root / "train.parquet"),
            "saved": str(root / "saved")}
