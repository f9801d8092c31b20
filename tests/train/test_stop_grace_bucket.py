"""SIGTERM always ends a run in time (design §7.3): `python -m dflash_jax.train` on a bucket workdir
(fake-gcs-server, tests/gcs_fixture.py) writes nothing there but its checkpoints (no metrics until the end); the
bucket stops answering, and once a checkpoint save has sent a request into the silence (the save is stuck), the
process gets SIGTERM. It exits with code 76 within config.stop_grace_seconds (plus a margin) with one line naming
the last complete checkpoint and the save in flight; once the bucket answers again, the rerun of the same command
resumes from exactly the one of those two the bucket holds complete (the stuck request may have been the save's
commit marker, which lands late). The steps that line names are the Checkpointer's in-memory account of its saves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gcs_fixture import gcs_server, trapped, unanswering
from tests.train_fixtures import make_target, write_corpus

REPO = Path(__file__).resolve().parents[2]
GRACE, MARGIN = 5.0, 10.0  # the margin: a step in flight and the watchdog's poll on a loaded machine
WORKDIR = "gs://dflash/run"
LINE = re.compile(r"error: stop grace expired: the stop by SIGTERM at \S+ did not finish within 5 s "
                  r"\(config.stop_grace_seconds\); the last complete checkpoint is step (\d+) in "
                  rf"{WORKDIR}/checkpoints: a rerun resumes from it(?:, or from step (\d+) if that save in flight "
                  r"completes)? \(exit code 76\)")


@pytest.mark.slow  # two train commands: a minute or more on 2 shared cores (make test-slow)
def test_sigterm_during_a_stuck_bucket_save_exits_76_in_time_and_the_rerun_resumes_from_the_named_step(tmp_path):
    target, corpus = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl")
    with gcs_server() as fs:
        fs.mkdir("dflash")

        def command(steps: int) -> list[str]:
            return [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
                    "--workdir", WORKDIR, f"--config.target_dir={target}", f"--config.data.train_files={corpus}",
                    "--config.data.seq_len=64", "--config.drafter.block_size=8", "--config.drafter.sliding_window=24",
                    "--config.mesh.fsdp=1", "--config.log_every=1000", "--config.checkpoint_every=2",
                    f"--config.stop_grace_seconds={GRACE}", "--config.storage.deadline_seconds=300",
                    f"--config.total_steps={steps}"]

        # STORAGE_EMULATOR_HOST (set by gcs_server) reaches the trainer through the environment.
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   JAX_DISABLE_MOST_OPTIMIZATIONS="1", DFLASH_JAX_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
        process = subprocess.Popen(command(100000), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while not fs.exists("dflash/run/checkpoints/2/commit_success.txt"):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint was saved in time"
            time.sleep(0.5)
            fs.invalidate_cache()

        saving = []  # the checkpoint requests sent into the silence
        with unanswering(), trapped(lambda head: saving.append("/checkpoints/" in head) and False, lambda: None):
            while not any(saving):
                assert process.poll() is None, process.communicate()[1][-3000:]
                time.sleep(0.1)
            time.sleep(1.0)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            stderr = process.communicate(timeout=GRACE + 120)[1]
            seconds = time.monotonic() - signalled
        assert process.returncode == 76, stderr[-3000:]
        assert seconds < GRACE + MARGIN, f"exited {seconds:.1f} s after SIGTERM"
        line = stderr.strip().splitlines()[-1]
        named = LINE.fullmatch(line)
        assert named, line
        step, in_flight = int(named.group(1)), named.group(2) and int(named.group(2))
        assert step >= 2
        # The stuck save's last request may have been its commit marker: once the bucket answers again it lands,
        # and that save is complete after all. The rerun resumes from whichever of the two steps the bucket holds.
        time.sleep(3.0)  # the requests the bucket held are answered now
        fs.invalidate_cache()
        if in_flight and fs.exists(f"dflash/run/checkpoints/{in_flight}/commit_success.txt"):
            step = in_flight

        rerun = subprocess.run(command(step + 1), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert f"resuming from {WORKDIR}/checkpoints at step {step}" in rerun.stderr
        assert fs.exists(f"dflash/run/checkpoints/{step + 1}/commit_success.txt")


def test_the_resume_point_names_the_newest_save_the_manager_has_waited_for(tmp_path):
    """What the expired grace's line names, known without a storage call: nothing before the first save has
    finished, a save only once the manager has waited for it, and after a restart the step restored."""
    import jax.numpy as jnp

    from dflash_jax.train.checkpoint import Checkpointer

    state = {"w": jnp.arange(4.0)}
    checkpointer = Checkpointer(tmp_path, keep=3)
    where = tmp_path / "checkpoints"
    assert checkpointer.resume_point() == f"no checkpoint in {where} is complete: a rerun starts from step 0"
    checkpointer.save(2, state, {"cursor": 2})
    assert checkpointer.resume_point() == (f"no checkpoint in {where} is complete: a rerun starts from step 0, "
                                           "or from step 2 if that save in flight completes")
    checkpointer.save(4, state, {"cursor": 4})  # waits for step 2 first
    assert checkpointer.resume_point() == (f"the last complete checkpoint is step 2 in {where}: a rerun resumes "
                                           "from it, or from step 4 if that save in flight completes")
    checkpointer.close()
    assert "is step 4 in" in checkpointer.resume_point()

    restarted = Checkpointer(tmp_path, keep=3)
    step, restored, data = restarted.restore_latest(state)
    assert (step, data) == (4, {"cursor": 4}) and "is step 4 in" in restarted.resume_point()
    restarted.close()
