"""`regenerate --out gs://...` against a real GCS-protocol server on loopback (tests/gcs_fixture.py): the output
and its progress file are staged locally and uploaded whole (object stores have no append, design §7.1), and a
rerun resumes from what the store holds, to the local output byte for byte, every record once; several
processes' parts beside a bucket output merge there."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from dflash_jax.runtime.paths import cached_path
from dflash_jax.regeneration import output, shares
from dflash_jax.regeneration.output import PROGRESS_SUFFIX, ResumableJsonl
from tests.gcs_fixture import gcs_server
from tests.openai_server import OpenAIServer
from tests.regeneration_fixtures import canned, run_server, write_jsonl
from tests.tokenizer_fixture import make_chat_tokenizer

OUT = "gs://regen/out.jsonl"


def test_a_killed_job_resumes_from_what_the_bucket_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(output, "UPLOAD_EVERY_S", 0.0)  # every append uploaded, as a long job's are
    with gcs_server() as fs:
        fs.mkdir("regen")
        writer = ResumableJsonl(OUT, {"seed": 0})
        writer.append([{"n": 0}, {"n": 1}], records_consumed=3)
        assert fs.cat_file("regen/out.jsonl") == b'{"n": 0}\n{"n": 1}\n'
        # Killed (no close) after the output's upload of the next batch but before its progress file's.
        fs.pipe_file("regen/out.jsonl", b'{"n": 0}\n{"n": 1}\n{"n": 2}\n{"n": 3')
        cached_path(OUT).write_text("left by another job\n")  # the store, not a stale stage, is continued
        resumed = ResumableJsonl(OUT, {"seed": 0})
        assert (resumed.records_done, resumed.lines) == (3, 2)
        resumed.append([{"n": 2}], records_consumed=1)
        resumed.close()
        assert fs.cat_file("regen/out.jsonl") == b'{"n": 0}\n{"n": 1}\n{"n": 2}\n'
        assert json.loads(fs.cat_file(f"regen/out.jsonl{PROGRESS_SUFFIX}"))["records_done"] == 4
        assert not cached_path(OUT).exists()  # nothing kept locally once the store holds it all
        with pytest.raises(ValueError, match=r"gs://regen/out.jsonl: was generated with other settings"):
            ResumableJsonl(OUT, {"seed": 1})
        fs.pipe_file("regen/foreign.jsonl", b'{"prompt": "x", "completion": "y"}\n')
        with pytest.raises(ValueError, match="gs://regen/foreign.jsonl: exists, but without foreign.jsonl"):
            ResumableJsonl("gs://regen/foreign.jsonl", {})


def test_regenerating_through_a_server_into_a_bucket_equals_the_local_output(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    make_chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    records = [{"prompt": f"Hello world number {i}", "i": i} for i in range(12)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", records)
    with OpenAIServer(tokenizer, canned(tokenizer)) as server:
        run_server([server], prompts, tmp_path / "local.jsonl", tmp_path / "tokenizer", concurrency=2)
    refused = tokenizer("Hello world number 7", add_special_tokens=False)["input_ids"]
    with gcs_server() as fs:
        fs.mkdir("regen")
        with OpenAIServer(tokenizer, canned(tokenizer),
                          fault=lambda body, n: ("status", 400) if body["prompt"] == refused else None) as server:
            with pytest.raises(ValueError, match="HTTP 400"):  # the job stops; what it finished is uploaded
                run_server([server], prompts, OUT, tmp_path / "tokenizer", concurrency=2)
        done = json.loads(fs.cat_file(f"regen/out.jsonl{PROGRESS_SUFFIX}"))["records_done"]
        assert 0 < done <= 7 and len(fs.cat_file("regen/out.jsonl").splitlines()) == done
        with OpenAIServer(tokenizer, canned(tokenizer)) as server:
            summary = run_server([server], prompts, OUT, tmp_path / "tokenizer", concurrency=2)
        assert summary.written == len(records) - done
        assert fs.cat_file("regen/out.jsonl") == (tmp_path / "local.jsonl").read_bytes()


def test_the_parts_of_several_processes_merge_in_the_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    with gcs_server() as fs:
        fs.mkdir("regen")
        parts = [ResumableJsonl(shares.part_path(OUT, p, 2), {"process": p}) for p in range(2)]
        parts[0].append([{"i": 0}, None], records_consumed=2)  # records 0 and 2 (2: not written)
        parts[1].append([{"i": 1}, {"i": 3}], records_consumed=2)  # records 1 and 3
        for part in parts:
            part.close()
        with pytest.raises(ValueError, match="has parts of a run with another number of processes"):
            shares.check_no_foreign_parts(OUT, 3)
        merged = ResumableJsonl(OUT, {})
        shares.merge_parts(merged, 2, total=4)
        merged.close()
        assert fs.cat_file("regen/out.jsonl") == b'{"i": 0}\n{"i": 1}\n{"i": 3}\n'
        assert sorted(fs.ls("regen")) == ["regen/out.jsonl", f"regen/out.jsonl{PROGRESS_SUFFIX}"]  # parts gone
