"""Faults of a training run in a bucket (fake-gcs-server, tests/gcs_fixture.py), each checked against one
uninterrupted run on local disk (design §7, §7.2): the final parameters, optimizer state and data position equal,
the exported drafter byte for byte, and metrics.jsonl holds every step exactly once with the same losses.

- Kills: `python -m dflash_jax.train` is SIGKILLed six times, each while a chosen request is on its way to the
  bucket (`trapped`: the request is held and the trainer killed): inside a checkpoint save (a TensorStore or Orbax
  upload), inside the upload of metrics.jsonl, inside the rewrite of metrics.jsonl that a resume makes. Which
  request of its kind is random (seeded); every kill is followed by a rerun of the same command.
- An outage: the bucket is gone for a few seconds (the run rides it out within the storage deadline), then for
  longer than the deadline (the run stops with one line and exit code 74 within it); the rerun, with the bucket
  back, resumes."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dflash_jax.commands.export import export
from dflash_jax.runtime.storage import EXIT_STORAGE_OUTAGE
from tests.command import SCRIPT, user_error
from tests.gcs_fixture import held, gcs_server, nth_match, stopped, trapped
from tests.train_fixtures import make_target, restore_last, tiny_config, write_corpus

REPO = Path(__file__).resolve().parents[2]
STEPS, SEED, WORKDIR = 12, 0, "gs://dflash/run"
SETTINGS = {"data.seq_len": 64, "drafter.block_size": 8, "drafter.sliding_window": 24, "mesh.fsdp": 1,
            "target_dtype": "float32", "compute_dtype": "float32", "loss.noise_std": 0.1, "total_steps": STEPS,
            "log_every": 1, "checkpoint_every": 1, "keep_checkpoints": 2}
# What a kill interrupts, by the request on its way (its head, %-escapes decoded), and from which of those
# requests of a run the kill is drawn: a save writes about thirty objects, a step's metrics one.
KINDS = {
    "checkpoint save": (lambda head: head.startswith("POST /upload/") and "/checkpoints/" in head, (5, 60)),
    "metrics upload": (lambda head: head.startswith("POST /upload/") and "run/metrics.jsonl\"" in head, (1, 4)),
    "metrics rewrite": (lambda head: "run/metrics.jsonl.tmp" in head, (1, 3)),
}
ORDER = ("checkpoint save", "metrics rewrite", "metrics upload") * 2  # a rewrite follows a run killed mid-save


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bucket_faults")
    return make_target(root / "target"), write_corpus(root / "train.jsonl"), root


def command(workdir: str, files) -> list[str]:
    target, corpus, _ = files
    return [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
            "--workdir", workdir, f"--config.target_dir={target}", f"--config.data.train_files={corpus}",
            *(f"--config.{key}={value}" for key, value in SETTINGS.items())]


def environment(root: Path, **extra: str) -> dict[str, str]:
    """One device, unoptimised compiles and a compilation cache the runs share: each start takes seconds."""
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
                JAX_COMPILATION_CACHE_DIR=str(root / "compile_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                DFLASH_JAX_CACHE=str(root / "cache"), PYTHONPATH=str(REPO), **extra)


@pytest.fixture(scope="module")
def straight(files):
    """The uninterrupted run on local disk and its export."""
    root = files[2]
    result = subprocess.run(command(str(root / "straight"), files), cwd=REPO, env=environment(root),
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    export(str(root / "straight"), str(root / "straight_export"))
    return root / "straight"


def assert_ends_like(workdir: str, straight: Path, files, export_to: Path) -> None:
    from etils import epath

    lines = epath.Path(workdir, "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == list(range(1, STEPS + 1)), steps  # each step once, in order
    expected = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [json.loads(line)["loss"] for line in lines] == [record["loss"] for record in expected]  # bit for bit
    config = tiny_config(*files[:2], **SETTINGS)
    straight_step, straight_state, straight_data = restore_last(straight, config)
    step, state, data = restore_last(epath.Path(workdir), config)
    assert step == straight_step == STEPS and data == straight_data
    jax.tree.map(np.testing.assert_array_equal, state, straight_state)
    export(workdir, str(export_to))
    for name in ("model.safetensors", "config.json"):
        assert (export_to / name).read_bytes() == (straight.parent / "straight_export" / name).read_bytes(), name


@pytest.mark.slow  # eight train commands: about two minutes on 2 shared cores (make test-slow)
def test_kills_inside_saves_uploads_and_the_metrics_rewrite_lose_nothing(files, straight):
    root, rng = files[2], random.Random(SEED)
    with gcs_server() as fs:
        fs.mkdir("dflash")
        killed: list[str] = []
        for kind in ORDER:
            matches, nth = KINDS[kind][0], rng.randint(*KINDS[kind][1])
            process = subprocess.Popen(command(WORKDIR, files), cwd=REPO, env=environment(root),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            with trapped(nth_match(matches, nth), lambda: (process.kill(), killed.append(kind))):
                stderr = process.communicate(timeout=900)[1]
            assert process.returncode == -9, f"{kind} #{nth} was not reached: {stderr[-3000:]}"
        assert killed == list(ORDER)

        final = subprocess.run(command(WORKDIR, files), cwd=REPO, env=environment(root), capture_output=True,
                               text=True, timeout=900)
        assert final.returncode == 0, final.stderr[-3000:]
        assert_ends_like(WORKDIR, straight, files, root / "killed_export")


def logged_step(fs) -> int:
    try:
        return max((json.loads(line)["step"] for line in fs.cat_file("dflash/run/metrics.jsonl").splitlines()),
                   default=0)
    except FileNotFoundError:
        return 0


@pytest.mark.slow  # two train commands and two outages: about a minute and a half on 2 cores (make test-slow)
def test_an_outage_is_ridden_out_within_the_deadline_or_stops_the_run_with_74_and_loses_nothing(files, straight):
    root, deadline = files[2], 30.0
    with gcs_server() as fs:
        fs.mkdir("dflash")
        process = subprocess.Popen([*command(WORKDIR, files), f"--config.storage.deadline_seconds={deadline:g}"],
                                   cwd=REPO, env=environment(root), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)

        def wait_for_step(step: int) -> int:
            limit = time.monotonic() + 900
            while (reached := logged_step(fs)) < step:
                assert process.poll() is None, process.communicate()[1][-3000:]
                assert time.monotonic() < limit, f"step {step} was not reached"
                time.sleep(0.2)
                fs.invalidate_cache()
            return reached

        wait_for_step(2)
        with stopped():  # shorter than the deadline: ridden out
            time.sleep(5.0)
            assert process.poll() is None
        before = wait_for_step(logged_step(fs) + 2)
        with stopped():  # longer than the deadline: the run stops
            began = time.monotonic()
            stderr = process.communicate(timeout=deadline + 120)[1]
            took = time.monotonic() - began
        assert process.returncode == EXIT_STORAGE_OUTAGE, stderr[-3000:]
        assert took < deadline + 10.0 + 15.0, f"stopped {took:.0f} s into the outage"  # + closing, + a margin
        line = stderr.strip().splitlines()[-1]
        assert re.fullmatch(r"error: storage outage: .*gs://dflash/run.*|error: storage outage: .*/dflash/o.*", line), \
            line
        assert before < STEPS, "the run ended before the outage"

        rerun = subprocess.run(command(WORKDIR, files), cwd=REPO, env=environment(root), capture_output=True,
                               text=True, timeout=900)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert "resuming from gs://dflash/run/checkpoints at step" in rerun.stderr
        assert_ends_like(WORKDIR, straight, files, root / "outage_export")



@pytest.mark.slow  # two pairs of train commands at once: about 70 s on 2 shared cores (make test-slow)
@pytest.mark.parametrize("late", [0.0, 1.5], ids=["same instant", "one lock write late"])
def test_of_two_trainers_started_at_once_on_one_bucket_workdir_one_runs_and_the_other_is_refused(files, late):
    """The lock is an exclusive create: whether the two lock writes land together or one more than a second after
    the other (held back by the relay), exactly one trainer runs and the other stops with one line naming it."""
    root, workdir = files[2], f"gs://dflash/race{int(late * 10)}"
    train = [str(SCRIPT), "train", *command(workdir, files)[3:], "--config.total_steps=2"]
    with gcs_server() as fs, held(lock_writes_released_together(late)):
        fs.mkdir("dflash")
        trainers = [subprocess.Popen(train, cwd=REPO, env=environment(root), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [subprocess.CompletedProcess(trainer.args, trainer.wait(timeout=900), "", trainer.stderr.read())
                   for trainer in trainers]
    assert sorted(result.returncode for result in results) == [0, 2], [
        (result.returncode, result.stderr[-2000:]) for result in results]
    refused = next(result for result in results if result.returncode)
    winner = next(trainer for trainer, result in zip(trainers, results) if result.returncode == 0)
    assert re.search(f"another trainer is running in this workdir \\(host .*, pid {winner.pid},",
                     user_error(refused))


def lock_writes_released_together(late: float):
    """For `held`: the first lock write on its way waits for the second one, then `late` seconds more, so that
    both trainers have found no lock before either writes one (started at once, their starts still differ)."""
    second, writes = threading.Event(), iter(range(2))

    def hold(head: str) -> None:
        if not (head.startswith("POST /upload/") and "lock.json\"" in head):
            return
        if next(writes, None) == 0:
            second.wait(timeout=120)
            time.sleep(late)
        else:
            second.set()

    return hold
