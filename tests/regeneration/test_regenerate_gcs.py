"""`regenerate --out gs://...` against a real GCS-protocol server on loopback (tests/gcs_fixture.py): the output
and its progress file are staged locally and uploaded whole (object stores have no append, design §7.1), and a
rerun resumes from what the store holds, to the local output byte for byte, every record once, also after kills
inside its uploads; several
processes' parts beside a bucket output merge there, and a stop asked of one process stops them all after the same
window, every part consistent, for a rerun of as many processes to finish (a rerun of another number is refused)."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_jax.commands.regenerate import STOPPED_EXIT_CODE
from dflash_jax.runtime.paths import cached_path
from dflash_jax.regeneration import output, shares
from dflash_jax.regeneration.job import WINDOW_BATCHES
from dflash_jax.regeneration.output import PROGRESS_SUFFIX, ResumableJsonl
from tests.gcs_fixture import gcs_server, nth_match, trapped
from tests.openai_server import OpenAIServer
from tests.process_fixtures import DEVICES_PER_PROCESS, cpu_env, outputs_of, start_two_processes
from tests.regeneration_fixtures import canned, run_server, write_jsonl
from tests.tokenizer_fixture import make_chat_tokenizer
from tests.train_fixtures import make_target

REPO = Path(__file__).resolve().parents[2]

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
        with pytest.raises(ValueError, match=r"the parts of a job of 2 processes .*, not 3: rerun it with 2 processes"):
            shares.check_no_foreign_parts(OUT, 3)
        merged = ResumableJsonl(OUT, {})
        shares.merge_parts(merged, 2, total=4)
        merged.close()
        assert fs.cat_file("regen/out.jsonl") == b'{"i": 0}\n{"i": 1}\n{"i": 3}\n'
        assert sorted(fs.ls("regen")) == ["regen/out.jsonl", f"regen/out.jsonl{PROGRESS_SUFFIX}"]  # parts gone


def dropped(log: str) -> int:
    """The records a regenerate run (its process 0's summary line) counted as not written."""
    found = re.search(r"(\d+) empty completions dropped, (\d+) prompts too long skipped", log)
    return int(found[1]) + int(found[2])


@pytest.mark.slow  # four regenerate starts, two of them two processes: about two minutes on 2 cores (make test-slow)
def test_a_stop_on_one_process_stops_every_process_after_the_same_window_and_a_rerun_of_as_many_finishes(
        tmp_path, monkeypatch):
    """Two processes (jax.distributed on CPU) regenerate into the bucket; SIGTERM reaches process 1 only, once it
    has written a window. Both stop (exit code 75) after the same window, each part holding whole windows; a
    rerun of one process is refused with one line saying the job needs two; a rerun of two finishes: every
    record exactly once, in input order, the parts gone."""
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    window = WINDOW_BATCHES * DEVICES_PER_PROCESS  # records per window at --batch_size=DEVICES_PER_PROCESS
    records = [{"prompt": f"Hello world number {i} " + "please " * (i % 3), "i": i} for i in range(10 * window)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", records)
    config_file = tmp_path / "config.py"
    config_file.write_text("from tests.train_fixtures import tiny_config\n\n\ndef get_config():\n"
                           f"    return tiny_config({str(make_target(tmp_path / 'target', num_layers=2))!r}, "
                           f"{str(prompts)!r})\n")
    command = [sys.executable, "-m", "dflash_jax.regenerate", f"--config={config_file}", f"--prompts={prompts}",
               f"--batch_size={DEVICES_PER_PROCESS}", "--max_new_tokens=6", "--quiet", f"--out={OUT}"]
    part_progress = [cached_path(f"{shares.part_path(OUT, p, 2)}{PROGRESS_SUFFIX}") for p in range(2)]

    def progress(part: int) -> dict:
        return json.loads(part_progress[part].read_text()) if part_progress[part].is_file() else {"records_done": 0}

    with gcs_server() as fs:
        fs.mkdir("regen")
        processes = start_two_processes(command)  # STORAGE_EMULATOR_HOST reaches both through the environment
        deadline = time.monotonic() + 600
        while progress(1)["records_done"] < window:  # the staged copy: written at once, uploaded at the end
            assert all(p.poll() is None for p in processes), [p.communicate()[0][-3000:] for p in processes]
            assert time.monotonic() < deadline, "process 1 wrote no window in time"
            time.sleep(0.05)
        processes[1].send_signal(signal.SIGTERM)
        logs = outputs_of(processes, returncode=STOPPED_EXIT_CODE)
        assert "stopped by a stop on another process" in logs[0] and "stopped by SIGTERM" in logs[1]
        parts = [json.loads(fs.cat_file(f"regen/out.jsonl.part-{p}-of-2{PROGRESS_SUFFIX}")) for p in range(2)]
        done = {part["records_done"] for part in parts}
        assert len(done) == 1 and done.pop() % window == 0, parts  # the same whole windows on both
        assert 0 < parts[0]["records_done"] < len(records) // 2
        for p, part in enumerate(parts):  # a line per record of the share, null for one not written
            assert len(fs.cat_file(f"regen/out.jsonl.part-{p}-of-2").splitlines()) == part["lines"] == \
                part["records_done"]
        assert not fs.exists("regen/out.jsonl")  # merged only once every share is done

        one = subprocess.run(command, cwd=REPO, env=cpu_env(DEVICES_PER_PROCESS), capture_output=True, text=True,
                             timeout=600)
        assert one.returncode == 2, one.stderr[-3000:]
        assert re.fullmatch(r"error: gs://regen/out.jsonl: has the parts of a job of 2 processes \(.*\), not 1: "
                            r"rerun it with 2 processes to finish it, or remove the parts to start over",
                            one.stderr.strip().splitlines()[-1]), one.stderr[-3000:]

        finished = outputs_of(start_two_processes(command))
        indices = [json.loads(line)["i"] for line in fs.cat_file("regen/out.jsonl").decode().splitlines()]
        assert indices == sorted(set(indices))  # at most once each, in input order
        # The others: an empty completion or a prompt too long, each counted by the run that met it.
        assert len(records) - len(indices) == sum(dropped(log) for log in (logs[0], finished[0]))
        assert json.loads(fs.cat_file(f"regen/out.jsonl{PROGRESS_SUFFIX}"))["records_done"] == len(records)
        assert sorted(fs.ls("regen")) == ["regen/out.jsonl", f"regen/out.jsonl{PROGRESS_SUFFIX}"]  # parts gone


# `regenerate`, uploading the output at every append (as a long job's appends all are, each past UPLOAD_EVERY_S).
EVERY_APPEND_UPLOADED = ("from dflash_jax.regeneration import output; output.UPLOAD_EVERY_S = 0.0; "
                         "from dflash_jax.commands import cli; cli.run_module('regenerate')")
# The uploads a kill lands in: the output's (its progress not yet sent), or its progress file's (the output sent).
UPLOADS = {"output upload": '"name": "out.jsonl"', "progress upload": f'"name": "out.jsonl{PROGRESS_SUFFIX}"'}


@pytest.mark.slow  # seven regenerate commands: about a minute and a half on 2 shared cores (make test-slow)
def test_kills_inside_the_uploads_of_a_bucket_output_leave_every_record_once_in_order(tmp_path, tokenizer_dir):
    """`regenerate --server ... --out gs://...` is SIGKILLed six times, each while an upload of the output or of its
    progress file is on its way to the bucket (which of them: random, seeded), and rerun each time; the output
    the last run leaves equals an uninterrupted local run's byte for byte."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = [{"prompt": f"Hello world number {i}", "i": i} for i in range(200)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", records)
    rng = random.Random(0)
    with OpenAIServer(tokenizer, canned(tokenizer), delay_s=0.05) as server:
        run_server([server], prompts, tmp_path / "local.jsonl", tokenizer_dir, concurrency=2)
        command = [sys.executable, "-c", EVERY_APPEND_UPLOADED, f"--server={server.url}", f"--prompts={prompts}",
                   f"--out={OUT}", f"--tokenizer={tokenizer_dir}", "--max_new_tokens=8", "--concurrency=2", "--quiet"]
        with gcs_server() as fs:
            env = dict(cpu_env(1), DFLASH_JAX_CACHE=str(tmp_path / "cache"))
            fs.mkdir("regen")
            for kind in ("output upload", "progress upload") * 3:
                nth = rng.randint(1, 6)
                process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True)
                with trapped(nth_match(lambda head: UPLOADS[kind] in head, nth), process.kill):
                    stderr = process.communicate(timeout=600)[1]
                assert process.returncode == -9, f"{kind} #{nth} was not reached: {stderr[-3000:]}"
            final = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            assert final.returncode == 0, final.stderr[-3000:]
            assert fs.cat_file("regen/out.jsonl") == (tmp_path / "local.jsonl").read_bytes()
