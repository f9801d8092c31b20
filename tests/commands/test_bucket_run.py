"""A run in a bucket (fake-gcs-server on loopback, tests/gcs_fixture.py), through the console script with the
commands a local run uses: data, target and workdir at gs:// URLs. The reference is the same run on local disk
(design §7.1): the bucket run, stopped after its first step and rerun with more steps, resumes from its
checkpoint in the bucket and logs the uninterrupted local run's losses; `evaluate` of the bucket workdir gives
the local workdir's figures, and `export` of it to the bucket the local export's files. A bucket that is gone or
stalls ends each of those commands in time with one line (design §7.2)."""

from __future__ import annotations

import json
import re
import time

import pytest

from dflash_jax.commands.export import export
from dflash_jax.runtime.storage import DEADLINE_ENV, EXIT_STORAGE_OUTAGE
from tests.command import dflash_jax
from tests.gcs_fixture import gcs_server, stopped, unanswering
from tests.train_fixtures import make_target, write_corpus

TINY = "configs/tiny.py"
SMALL = ("--config.data.seq_len=64", "--config.drafter.sliding_window=24", "--config.log_every=1",
         "--config.mesh.fsdp=1")
EVAL = ("--num_prompts=2", "--max_new_tokens=8", "--budgets=4")
EXPORTED = ("config.json", "model.safetensors")


def run(*args: str) -> str:
    """`dflash-jax *args`; its stderr (the log)."""
    result = dflash_jax(*args, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def train(workdir: str, target: str, corpus: str, steps: int) -> str:
    # No warmup at these lengths, so step 1's learning rate is the peak whatever total_steps is: a run of one
    # step continued to two takes the steps of a run of two.
    return run("train", "--config", TINY, "--workdir", workdir, f"--config.target_dir={target}",
               f"--config.data.train_files={corpus}", *SMALL, f"--config.total_steps={steps}")


def evaluate(workdir: str, target: str, corpus: str, out: str) -> None:
    run("evaluate", "--config", TINY, "--workdir", workdir, "--json", out, f"--config.target_dir={target}",
        f"--config.data.eval_files={corpus}", *SMALL, *EVAL)


def losses(metrics: str) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.splitlines()]
    assert len({record["step"] for record in records}) == len(records), metrics  # each step logged once
    return {record["step"]: record["loss"] for record in records}


def figures(evaluation: bytes) -> dict:
    """What `evaluate --json` measured (its paths name the run's own files)."""
    results = json.loads(evaluation)
    return {name: results[name] for name in ("trained", "untrained")}


@pytest.mark.slow  # six commands one after another: 381 s on 2 cores shared at load average 12 (make test-slow)
def test_training_resuming_evaluating_and_exporting_in_a_bucket_match_the_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))  # the command's copy of the target
    target, corpus = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl", count=40)
    local = tmp_path / "run"
    train(str(local), str(target), str(corpus), steps=2)
    evaluate(str(local), str(target), str(corpus), str(tmp_path / "eval.json"))
    export(str(local), str(tmp_path / "drafter"))  # what the command runs, without starting one more process
    reference = losses((local / "metrics.jsonl").read_text())
    assert sorted(reference) == [1, 2]
    with gcs_server() as fs:
        fs.mkdir("dflash")
        fs.put(str(target), "dflash/target", recursive=True)
        fs.put_file(str(corpus), "dflash/train.jsonl")
        bucket = ("gs://dflash/run", "gs://dflash/target", "gs://dflash/train.jsonl")
        train(*bucket, steps=1)
        assert losses(fs.cat_file("dflash/run/metrics.jsonl").decode()) == pytest.approx({1: reference[1]})
        log = train(*bucket, steps=2)
        assert "resuming from gs://dflash/run/checkpoints at step 1" in log
        assert losses(fs.cat_file("dflash/run/metrics.jsonl").decode()) == pytest.approx(reference)
        assert fs.exists("dflash/run/checkpoints/2/commit_success.txt")
        assert fs.exists("dflash/run/drafter_config.json") and not fs.exists("dflash/run/lock.json")
        assert fs.find("dflash/run/tensorboard")

        evaluate(*bucket, "gs://dflash/eval.json")
        assert figures(fs.cat_file("dflash/eval.json")) == figures((tmp_path / "eval.json").read_bytes())
        run("export", "--workdir", "gs://dflash/run", "--out", "gs://dflash/drafter")
        for name in EXPORTED:
            assert fs.cat_file(f"dflash/drafter/{name}") == (tmp_path / "drafter" / name).read_bytes(), name
        assert fs.exists("dflash/drafter/README.md")
    assert (tmp_path / "cache" / "urls" / "gs" / "dflash" / "target" / "model.safetensors").is_file()


@pytest.mark.slow  # nine commands, eight of them ending early: about two minutes on 2 shared cores (make test-slow)
def test_a_bucket_that_is_gone_or_stalls_ends_every_command_within_the_deadline_with_one_line(tmp_path, monkeypatch):
    """With the bucket gone (connections refused) or stalled (nothing answers), `train` (a fresh run and the rerun
    of one in the bucket), `evaluate` and `export` each end with exit code 74 and one line naming the operation
    and the gs:// path, within the storage deadline plus the time to close and to start the process."""
    deadline, startup = 5.0, 40.0  # startup: importing JAX and the rest on a loaded machine
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(DEADLINE_ENV, f"{deadline:g}")
    target, corpus = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl", count=40)
    with gcs_server() as fs:
        fs.mkdir("dflash")
        fs.put(str(target), "dflash/target", recursive=True)
        fs.put_file(str(corpus), "dflash/train.jsonl")
        train("gs://dflash/run", "gs://dflash/target", "gs://dflash/train.jsonl", steps=1)
        inputs = ("--config.target_dir=gs://dflash/target", "--config.data.train_files=gs://dflash/train.jsonl")
        commands = {
            "train": ("train", "--config", TINY, "--workdir", "gs://dflash/fresh", *inputs, *SMALL,
                      "--config.total_steps=2"),
            "rerun": ("train", "--config", TINY, "--workdir", "gs://dflash/run", *inputs, *SMALL,
                      "--config.total_steps=2"),
            "evaluate": ("evaluate", "--config", TINY, "--workdir", "gs://dflash/run", "--json",
                         "gs://dflash/eval.json", "--config.target_dir=gs://dflash/target",
                         "--config.data.eval_files=gs://dflash/train.jsonl", *SMALL, *EVAL),
            "export": ("export", "--workdir", "gs://dflash/run", "--out", "gs://dflash/drafter"),
        }
        for fault in (stopped, unanswering):
            with fault():
                for name, args in commands.items():
                    began = time.monotonic()
                    result = dflash_jax(*args, timeout=600)
                    took = time.monotonic() - began
                    where = f"{fault.__name__} bucket, {name}"
                    assert result.returncode == EXIT_STORAGE_OUTAGE, (where, result.stderr[-3000:])
                    assert "Traceback" not in result.stderr, (where, result.stderr[-3000:])
                    assert re.fullmatch(r"error: storage outage: \S+ gs://dflash/\S* failed \(.*\); nothing is lost: "
                                        r"rerun the same command when the storage answers again \(exit code 74\)",
                                        result.stderr.strip().splitlines()[-1]), (where, result.stderr[-3000:])
                    assert took < deadline + 10.0 + startup, (where, took)
        assert fs.exists("dflash/run/checkpoints/1/commit_success.txt") and not fs.exists("dflash/drafter")
