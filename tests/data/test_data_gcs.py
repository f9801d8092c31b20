"""Data sources in a bucket, against a real GCS-protocol server on loopback (fake-gcs-server, which gcsfs reaches
through STORAGE_EMULATOR_HOST): gs:// JSONL, zstd JSONL and Parquet give the local files' batches and resume
exactly; each host fetches only its share once, and no record costs a request (the batches keep coming with
the server stopped)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_jax.data import BatchLoader
from dflash_jax.data.jsonl import JsonlShare
from tests.data_fixtures import assert_same
from tests.gcs_fixture import gcs_server
from tests.tokenizer_fixture import make_qwen_tokenizer

OPTIONS = dict(seq_len=64, anchor_stride=8, seed=5, batch_size=2)


def loader(path: str, tokenizer, **overrides) -> BatchLoader:
    return BatchLoader([path], tokenizer, **{**OPTIONS, **overrides})


def test_bucket_sources_read_their_shares_once_and_give_the_local_batches(formats):  # noqa: F811
    tokenizer = make_qwen_tokenizer("qwen3_5")
    with gcs_server() as fs:
        fs.mkdir("data")
        for kind in ("jsonl", "zst", "parquet"):
            fs.put_file(formats[kind], f"data/{Path(formats[kind]).name}")
        urls = {kind: f"gs://data/{Path(formats[kind]).name}" for kind in ("jsonl", "zst", "parquet")}
        # Host 0 of two: rows [0] of every batch, its half of each file fetched at start-up.
        remote = {kind: loader(url, tokenizer, rows=[0]) for kind, url in urls.items()}
        share = remote["jsonl"].streams[0].corpus.shares[0]
        assert isinstance(share, JsonlShare)
        hi = fs.size("data/train.jsonl") // 2
        assert share.path != formats["jsonl"] and Path(share.path).stat().st_size <= hi + 4096
    # The server is gone: every record still comes, so none is a request of its own.
    for kind in urls:
        local = loader(formats[kind], tokenizer, rows=[0])
        for _ in range(30):
            assert_same(next(remote[kind]), next(local))


def test_a_bucket_source_resumes_exactly(formats):  # noqa: F811
    tokenizer = make_qwen_tokenizer("qwen3")
    with gcs_server() as fs:
        fs.mkdir("resume")
        fs.put_file(formats["jsonl"], "resume/train.jsonl")
        whole = loader("gs://resume/train.jsonl", tokenizer)
        for _ in range(11):
            next(whole)
        state = json.loads(json.dumps(whole.state()))
        expected = [next(whole) for _ in range(10)]
        resumed = [loader("gs://resume/train.jsonl", tokenizer, rows=[row], state=state) for row in (0, 1)]
        for batch in expected:
            parts = [next(r) for r in resumed]
            assert_same({key: np.concatenate([p[key] for p in parts]) for key in batch}, batch)
