"""Data sources (dflash_jax/data/sources.py): the same records as JSONL, compressed JSONL, Parquet and a
`save_to_disk` dataset give the same batches and resume exactly; tables split by rows over hosts; globs and
directories are their files; a weighted mix draws each source weight times per epoch; the loader's corpus token count
(config.epochs) counts what an epoch draws."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_jax.data import BatchLoader, merge_states, packed_length, resolve_sources, row_capacity, tokenize_record
from dflash_jax.data.records import parse_object
from dflash_jax.runtime.errors import DataError
from tests.data_fixtures import assert_same, completion_records, mixed_records, row_documents, write_jsonl
from tests.tokenizer_fixture import make_qwen_tokenizer

OPTIONS = dict(seq_len=64, anchor_stride=8, seed=5)


def loader(path, tokenizer, **overrides) -> BatchLoader:
    paths = [path] if isinstance(path, str) else path
    return BatchLoader(paths, tokenizer, **{**OPTIONS, "batch_size": 1, **overrides})


def test_every_format_gives_the_jsonl_batches_and_resumes_exactly(formats):
    # One row: every format's share is all of it, in the same record order, so the batches must be equal.
    tokenizer = make_qwen_tokenizer("qwen3_5")
    reference = loader(formats["jsonl"], tokenizer)
    states, batches = [], []
    for _ in range(80):  # past one epoch (split documents repeat half a row as context)
        states.append(json.loads(json.dumps(reference.state())))
        batches.append(next(reference))
    assert reference.streams[0].position()["epoch"] >= 1
    for kind in ("gz", "zst", "parquet", "saved"):
        other, position = loader(formats[kind], tokenizer), None
        for step, expected in enumerate(batches):
            position = json.loads(json.dumps(other.state())) if step == 23 else position
            assert_same(next(other), expected)
        assert position["rows"] == states[23]["rows"]  # the same point (the units of the source differ)
        resumed = loader(formats[kind], tokenizer, state=position)
        for expected in batches[23:]:
            assert_same(next(resumed), expected)


def test_tables_split_by_rows_over_hosts_and_resume_on_another_host_count(formats):
    tokenizer = make_qwen_tokenizer("qwen3")
    whole = loader(formats["parquet"], tokenizer, batch_size=4)
    saved = loader(formats["saved"], tokenizer, batch_size=4)
    hosts = [loader(formats["parquet"], tokenizer, batch_size=4, rows=rows) for rows in ([0, 1], [2, 3])]
    assert [h.num_records for h in hosts] == [18, 18] and whole.num_records == 36  # each host indexes its half
    for _ in range(6):
        batch = next(whole)
        assert_same(next(saved), batch)
        parts = [next(h) for h in hosts]
        assert_same({key: np.concatenate([p[key] for p in parts]) for key in batch}, batch)
    state = merge_states([h.state() for h in hosts])
    resumed = [loader(formats["saved"], tokenizer, batch_size=4, rows=[row], state=state) for row in range(4)]
    for _ in range(6):
        batch = next(whole)
        parts = [next(r) for r in resumed]
        assert_same({key: np.concatenate([p[key] for p in parts]) for key in batch}, batch)


def test_globs_and_directories_are_their_files_in_sorted_order(tmp_path):
    for name, seed in (("b.jsonl", 1), ("a.jsonl", 2), ("sub/c.jsonl", 3)):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        write_jsonl(tmp_path / name, completion_records(4, seed=seed))
    (tmp_path / "notes.txt").write_text("not data")
    names = lambda entry: [s.source.name for s in resolve_sources([entry], "f")]  # noqa: E731
    assert names(str(tmp_path)) == [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl")]
    assert names(f"{tmp_path}/**/*.jsonl") == [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl")]
    assert names(f"{tmp_path}/[ab].jsonl@2") == [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl")]
    assert [s.weight for s in resolve_sources([f"{tmp_path}/a.jsonl@0.5"], "f")] == [0.5]
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path))}/a.jsonl@-1: weight -1 must be"):
        resolve_sources([f"{tmp_path}/a.jsonl@-1"], "f")
    with pytest.raises(DataError, match=r"^nobody/nothing: not a file, and not a dataset in the local Hugging Face"):
        resolve_sources(["nobody/nothing"], "config.data.train_files")


def test_a_weighted_mix_draws_each_source_weight_times_per_epoch(tmp_path):
    tokenizer = make_qwen_tokenizer("qwen3")
    sources = {name: write_jsonl(tmp_path / f"{name}.jsonl",
                                 [{"prompt": "", "completion": f" {name} {i}"} for i in range(count)])
               for name, count in (("first", 20), ("second", 12), ("third", 10))}
    weights = {"first": 1, "second": 2, "third": 0.5}
    mix = loader([f"{sources[n]}@{w}" for n, w in weights.items()], tokenizer, batch_size=2, seq_len=128)
    epoch_lengths = [stream.corpus.epoch_length for stream in mix.streams]
    texts: list[list[str]] = [[], []]
    while min(len(t) for t in texts) < 2 * max(epoch_lengths):
        batch = next(mix)
        for row in range(2):
            texts[row] += [tokenizer.decode(d["input_ids"]).strip() for d in row_documents(batch, row)]
    for row, (length, stream) in enumerate(zip(epoch_lengths, mix.streams)):
        for epoch in range(2):
            drawn = texts[row][epoch * length:(epoch + 1) * length]
            shares = [len(share) for share in stream.corpus.shares]
            counts = [sum(t.split()[0] == name for t in drawn) for name in weights]
            assert counts == [int(w * n + 0.5) for w, n in zip(weights.values(), shares)]
            assert all(drawn.count(t) == 2 for t in drawn if t.startswith("second"))  # every record, twice
    halves = [set(t for t in texts[0][e * epoch_lengths[0]:(e + 1) * epoch_lengths[0]] if t.startswith("third"))
              for e in range(2)]
    assert halves[0] != halves[1]  # the fraction is a fresh subset each epoch
    assert abs(sum(epoch_lengths) - (20 + 2 * 12 + 0.5 * 10)) <= len(epoch_lengths) / 2  # rounded per row


def test_corpus_tokens_count_what_an_epoch_draws(formats, tmp_path):
    tokenizer = make_qwen_tokenizer("qwen3_5")
    records = [parse_object(r, "r") for r in mixed_records()]
    # Each document's tokens, plus the context the later pieces of one longer than a row repeat.
    capacity = row_capacity(OPTIONS["seq_len"], OPTIONS["anchor_stride"])
    lengths = [len(tokenize_record(r, tokenizer, "r")) for r in records]
    tokens = sum(packed_length(length, capacity) for length in lengths)
    assert max(lengths) > capacity and tokens > sum(lengths)  # some documents are split
    assert loader([formats["parquet"]], tokenizer).corpus_tokens() == tokens
    # Every row's share together is the corpus; a source of weight 0.5 counts half.
    mixed = loader([formats["jsonl"], f"{formats['saved']}@0.5"], tokenizer, batch_size=3)
    assert mixed.corpus_tokens() == round(1.5 * tokens)


def test_a_dataset_id_is_read_from_the_local_hugging_face_cache(tmp_path, monkeypatch):
    # The layout `hf download --repo-type dataset` leaves: a snapshot of the repo's data files, split by name.
    import datasets.config  # noqa: PLC0415
    from huggingface_hub import constants  # noqa: PLC0415

    repo = tmp_path / "hub" / "datasets--someone--chats"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    data = repo / "snapshots" / ("0" * 40) / "data"
    data.mkdir(parents=True)
    records = mixed_records(12)
    columns = ("messages", "prompt", "completion")
    train = pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in records])
    pq.write_table(train, data / "train_sft-00000-of-00001.parquet")
    pq.write_table(train.slice(0, 3), data / "test_sft-00000-of-00001.parquet")  # splits share their columns
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    tokenizer = make_qwen_tokenizer("qwen3")
    jsonl = write_jsonl(tmp_path / "train.jsonl", records)
    from_cache, reference = loader("someone/chats:train_sft", tokenizer), loader(str(jsonl), tokenizer)
    assert from_cache.num_records == 12
    for _ in range(8):
        assert_same(next(from_cache), next(reference))
    with pytest.raises(DataError, match=r"^someone/chats:validation: .*split"):
        resolve_sources(["someone/chats:validation"], "f")


def test_a_bad_table_row_is_named_by_file_and_row_and_can_be_skipped(tmp_path):
    rows = completion_records(8)
    rows[3] = {"prompt": "p", "completion": ""}
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tokenizer = make_qwen_tokenizer("qwen3")
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))} row 3: 'completion' is empty"):
        loader(str(path), tokenizer)
    skipping = loader(str(path), tokenizer, bad_records="skip")
    assert skipping.num_records == 7 and skipping.stats()["skipped_records"] == 1
