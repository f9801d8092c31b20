"""What a run does when its workdir is damaged or contested (docs/failure_handling.md): a corrupt latest
checkpoint is skipped with one warning line and the resume equals one from the previous checkpoint; no
readable checkpoint, or an export of an unreadable step, is one error line; the workdir's lock refuses a
live second trainer and takes over from a dead one; every accepted start is appended to the config history
and a refused one writes nothing; metrics of steps after the restored checkpoint are dropped."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from dflash_jax.runtime.errors import CheckpointError, DataError, WorkdirLockedError
from dflash_jax.commands.export import export
from dflash_jax.train.checkpoint import UNREADABLE_DIR
from dflash_jax.train.loop import train
from dflash_jax.runtime.workdir import (CONFIG_HISTORY, ERRORS_LOG, LOCK_FILE, METRICS_FILE, STALE_AFTER_SECONDS,
                                      WorkdirLock, drop_metrics_after)
from dflash_jax.weights.drafter_files import CHECKPOINTS_DIR
from tests.command import dflash_jax, user_error
from tests.train_fixtures import losses, make_target, tiny_config, training_workdir, write_corpus

# A trace that Python prints for an abandoned TensorStore read when it is collected would reach the console too.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


def damage(checkpoint) -> None:
    """Truncates the largest array file of a checkpoint, as a full disk or a kill of a copy would."""
    largest = max((path for path in (checkpoint / "state").rglob("*") if path.is_file()),
                  key=lambda path: path.stat().st_size)
    with open(largest, "r+b") as handle:
        handle.truncate(100)


def no_eval(step, drafter, target) -> dict:
    return {}  # the stopped run's config asks for evaluations; these tests check checkpoints, not τ


def run_files(workdir) -> dict[str, bytes]:
    return {name: (workdir / name).read_bytes() for name in (CONFIG_HISTORY, METRICS_FILE, "drafter_config.json")}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A 6-step run stopped (as by SIGTERM) after step 4, with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("failure_handling")
    config = tiny_config(make_target(root / "target"), write_corpus(root / "train.jsonl"), total_steps=6,
                         log_every=1, checkpoint_every=2, keep_checkpoints=5, eval_every=4)

    def stop_at_4(step, drafter, target):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    summary = train(config, root / "run", evaluate=stop_at_4)
    assert (summary["final_step"], summary["stopped_by"]) == (4, "SIGTERM")
    return config, root / "run"


def test_a_corrupt_latest_checkpoint_resumes_like_the_previous_step(stopped_run, tmp_path, caplog, capfd):
    config, stopped = stopped_run
    corrupt, previous = shutil.copytree(stopped, tmp_path / "corrupt"), shutil.copytree(stopped, tmp_path / "previous")
    damage(corrupt / CHECKPOINTS_DIR / "4")
    shutil.rmtree(previous / CHECKPOINTS_DIR / "4")  # the run that only ever had the step-2 checkpoint
    with caplog.at_level(logging.WARNING):
        resumed = train(config, corrupt, evaluate=no_eval)
        warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
        reference = train(config, previous, evaluate=no_eval)

    assert resumed["start_step"] == reference["start_step"] == 2
    assert losses(corrupt) == losses(previous)  # identical floats, each step once
    assert sorted(losses(corrupt)) == [1, 2, 3, 4, 5, 6]
    unreadable = [line for line in warnings if "is unreadable" in line]
    assert len(unreadable) == 1
    assert unreadable[0].startswith(f"checkpoint step 4 in {corrupt / CHECKPOINTS_DIR} is unreadable (")
    assert unreadable[0].endswith(f"full trace in {corrupt / ERRORS_LOG}); using step 2 instead")
    assert "Traceback" in (corrupt / ERRORS_LOG).read_text()
    assert not any("Traceback" in line for line in warnings) and "Traceback" not in capfd.readouterr().err
    assert (corrupt / UNREADABLE_DIR / "4" / "state").is_dir()  # kept for inspection, out of Orbax's sight
    history = [json.loads(line) for line in (corrupt / CONFIG_HISTORY).read_text().splitlines()]
    assert [entry["start_step"] for entry in history] == [0, 2]
    assert history[-1]["config"]["target_dir"] == config.target_dir
    assert not (corrupt / LOCK_FILE).exists()  # released at the end


def test_no_readable_checkpoint_and_a_refused_resume_write_nothing(stopped_run, tmp_path):
    config, stopped = stopped_run
    workdir = shutil.copytree(stopped, tmp_path / "run")
    before = run_files(workdir)

    other_rows = tiny_config(config.target_dir, config.data.train_files[0], total_steps=6,
                             **{"data.seq_len": 128})
    with pytest.raises(DataError, match=r"loader state: seq_len is 64 in the saved state but 128 now"):
        train(other_rows, workdir)
    assert run_files(workdir) == before

    for step in (2, 4):
        damage(workdir / CHECKPOINTS_DIR / str(step))
    with pytest.raises(CheckpointError) as refused:
        train(config, workdir, evaluate=no_eval)
    message = str(refused.value)
    assert message.startswith(f"{workdir / CHECKPOINTS_DIR}: no checkpoint is readable (steps 2, 4); the oldest, "
                              f"step 2, failed with: ")
    assert "\n" not in message
    assert run_files(workdir) == before  # neither start was recorded; no metrics were dropped
    assert sorted(path.name for path in (workdir / CHECKPOINTS_DIR).iterdir()) == ["2", "4"]
    assert not (workdir / LOCK_FILE).exists()


def test_export_falls_back_past_an_unreadable_latest_step_but_not_past_a_given_one(tmp_path, capsys, caplog):
    workdir, _, _ = training_workdir(tmp_path)
    damage(workdir / CHECKPOINTS_DIR / "4")
    result = dflash_jax("export", "--workdir", str(workdir), "--out", str(tmp_path / "export"), "--step", "4")
    line = user_error(result)
    assert line.startswith(f"error: {workdir / CHECKPOINTS_DIR}: checkpoint step 4 is unreadable (")
    # Nothing else but JAX's note on the backends it looked for: the trace is in the workdir's errors.log.
    assert [other for other in result.stderr.splitlines() if "xla_bridge" not in other] == [line]
    assert "Traceback" in (workdir / ERRORS_LOG).read_text()

    caplog.clear()  # what the training workdir's own saves logged
    with caplog.at_level(logging.WARNING):
        export(workdir, tmp_path / "export")
    assert f"exported step 2 of {workdir}" in capsys.readouterr().out
    assert [record.getMessage().split(" (")[0] for record in caplog.records if record.levelno >= logging.WARNING] \
        == [f"checkpoint step 4 in {workdir / CHECKPOINTS_DIR} is unreadable"]
    assert (workdir / CHECKPOINTS_DIR / "4").is_dir()  # the export only reads: it moves nothing


def write_lock(workdir, host: str, pid: int, heartbeat_age: float = 0.0, job: dict | None = None) -> None:
    now = time.time()
    (workdir / LOCK_FILE).write_text(json.dumps({"host": host, "pid": pid, "token": "other", "job": job,
                                                 "started": now - 3600, "heartbeat": now - heartbeat_age}))


def test_a_requeued_slurm_job_takes_the_lock_over_from_its_earlier_run(tmp_path, monkeypatch, caplog):
    """Requeued onto another host, the job finds its earlier run's lock with a fresh heartbeat (it was killed
    a moment ago): an earlier run of the same job is gone, so the lock is taken over, never refused. The same
    run of the job (two trainers in one allocation) and another job are still refused."""
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    for job in ({"id": "1234", "run": 1}, {"id": "999", "run": 0}, None):
        write_lock(tmp_path, "host-b", 4242, job=job)
        with pytest.raises(WorkdirLockedError, match=r"\(host host-b, pid 4242, started "):
            WorkdirLock(tmp_path).acquire()
    write_lock(tmp_path, "host-b", 4242, job={"id": "1234", "run": 0})
    lock = WorkdirLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert "host host-b, pid 4242: run 0 of Slurm job 1234, which is now in run 1" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["job"] == {"id": "1234", "run": 1}
    lock.release()
    monkeypatch.delenv("SLURM_RESTART_COUNT")  # the job's first run has no count: run 0
    write_lock(tmp_path, "host-b", 4242, job={"id": "1234", "run": 0})
    with pytest.raises(WorkdirLockedError):
        WorkdirLock(tmp_path).acquire()


def test_the_workdir_lock_refuses_a_live_holder_and_takes_over_from_a_dead_one(tmp_path, caplog):
    here = socket.gethostname()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(tmp_path, here, holder.pid)
        with pytest.raises(WorkdirLockedError, match=rf"another trainer is running in this workdir \(host {here}, "
                                                     rf"pid {holder.pid}, started "):
            WorkdirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    write_lock(tmp_path, "host-b", 4242)  # another host with a fresh heartbeat: may be alive
    with pytest.raises(WorkdirLockedError, match=r"\(host host-b, pid 4242, started "):
        WorkdirLock(tmp_path).acquire()

    for host, pid, age, why in ((here, holder.pid, 0, f"process {holder.pid} on this host is not running"),
                                ("host-b", 4242, STALE_AFTER_SECONDS + 5, "host host-b, pid 4242: no heartbeat for")):
        write_lock(tmp_path, host, pid, heartbeat_age=age)
        lock = WorkdirLock(tmp_path)
        with caplog.at_level(logging.WARNING):
            lock.acquire()
        assert why in caplog.text
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.release()
        assert not (tmp_path / LOCK_FILE).exists()
        caplog.clear()


def test_metrics_after_the_restored_step_and_a_torn_last_line_are_dropped(tmp_path):
    records = [json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 6)]
    (tmp_path / METRICS_FILE).write_text("".join(records) + '{"step": 6, "lo')  # killed in mid-write
    drop_metrics_after(tmp_path, 3)
    assert (tmp_path / METRICS_FILE).read_text() == "".join(records[:3])

