"""What each fault costs a training run in a bucket (design §7.2-§7.3): the fault, what the job did (its exit
code and last line), the time from the fault to the end of the process, and what was lost: the steps the rerun
trains again (those after the last complete checkpoint), which is all a fault may cost.

One job, `python -m dflash_jax.train` of the tiny target into gs://faults/run on fake-gcs-server (the tests'
fixture, tests/gcs_fixture.py: a bucket that stalls, one that is gone for a while, a kill while a chosen request
is on its way), met by one fault per run and rerun each time with the same command; the last run finishes, and
metrics.jsonl must then hold every step once. Storage deadline 20 s, stop grace 5 s, a checkpoint every 4 steps.
Then `regenerate` as two processes into the bucket, one of them signalled.

    PYTHONPATH=. .venv/bin/python -m bench.bench_faults
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS, DEADLINE, GRACE, EVERY = 60, 20.0, 5.0, 4


class Job:
    """The training job in the bucket and its runs."""

    def __init__(self, fs, root: Path):
        from tests.train_fixtures import make_target, write_corpus

        self.fs, self.root = fs, root
        target, corpus = make_target(root / "target"), write_corpus(root / "train.jsonl")
        self.command = [
            sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
            "--workdir", "gs://faults/run", f"--config.target_dir={target}", f"--config.data.train_files={corpus}",
            "--config.data.seq_len=64", "--config.drafter.block_size=8", "--config.drafter.sliding_window=24",
            "--config.mesh.fsdp=1", "--config.log_every=1", f"--config.checkpoint_every={EVERY}",
            f"--config.stop_grace_seconds={GRACE:g}", f"--config.storage.deadline_seconds={DEADLINE:g}",
            f"--config.total_steps={STEPS}"]
        self.env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                        JAX_DISABLE_MOST_OPTIMIZATIONS="1", JAX_COMPILATION_CACHE_DIR=str(root / "compile_cache"),
                        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", DFLASH_JAX_CACHE=str(root / "cache"),
                        PYTHONPATH=str(REPO))
        self.process: subprocess.Popen | None = None

    def start(self, wrap: Callable[[list[str]], list[str]] = lambda command: command) -> None:
        self.process = subprocess.Popen(wrap(self.command), cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)

    def logged(self) -> int:
        """The newest step in the bucket's metrics.jsonl."""
        self.fs.invalidate_cache()
        try:
            return max((json.loads(line)["step"] for line in self.fs.cat_file("faults/run/metrics.jsonl").splitlines()),
                       default=0)
        except FileNotFoundError:
            return 0

    def wait_for(self, step: int) -> None:
        while self.logged() < step:
            if self.process.poll() is not None:
                raise SystemExit(self.process.communicate()[1][-3000:])
            time.sleep(0.1)

    def end(self) -> tuple[int, str, str]:
        """(exit code, last line, the whole stderr) of the run."""
        stderr = self.process.communicate(timeout=900)[1]
        return self.process.returncode, (stderr.strip().splitlines() or [""])[-1], stderr


def resumed_from(stderr: str) -> int:
    found = re.search(r"resuming from \S+ at step (\d+)", stderr)
    return int(found[1]) if found else 0


def main() -> None:
    from tests.gcs_fixture import gcs_server, stopped, trapped, unanswering
    from tests.process_fixtures import on_a_full_disk

    runs = []  # [fault, exit code, last line, seconds to stop, newest step logged, stderr]
    with tempfile.TemporaryDirectory() as directory, gcs_server() as fs:
        fs.mkdir("faults")
        root = Path(directory)
        job = Job(fs, root)

        def faulted(name: str, inject: Callable[[], float | None], wrap=lambda command: command) -> None:
            """A run met by `inject`, which returns when the fault began (None: not known outside the process)."""
            job.start(wrap)
            began = inject()
            code, line, stderr = job.end()
            runs.append([name, code, line, None if began is None else time.monotonic() - began, job.logged(), stderr])

        def until_the_end(fault) -> Callable[[], float]:
            """The bucket met by `fault` (stalled or gone) a few steps into the run, until the run ends."""
            def inject() -> float:
                job.wait_for(job.logged() + 3)
                with fault():
                    began = time.monotonic()
                    job.process.wait()
                return began
            return inject

        def gone_briefly_then_stall() -> float:
            job.wait_for(job.logged() + 3)
            with stopped():
                time.sleep(5.0)
            job.wait_for(job.logged() + 2)  # it went on
            return until_the_end(unanswering)()

        def sigterm_in_a_stuck_save() -> float:
            job.wait_for(job.logged() + 3)
            saving = []
            with unanswering(), trapped(lambda head: saving.append("/checkpoints/" in head) and False, lambda: None):
                while not any(saving):
                    time.sleep(0.05)
                time.sleep(0.5)
                job.process.send_signal(signal.SIGTERM)
                began = time.monotonic()
                job.process.wait()
            return began

        def kill_in_a_save() -> float:
            job.wait_for(job.logged() + 3)
            killed = []
            with trapped(lambda head: head.startswith("POST /upload/") and "/checkpoints/" in head,
                         lambda: (job.process.kill(), killed.append(time.monotonic()))):
                job.process.wait()
            return killed[0]

        def full_cache() -> None:
            job.process.wait()  # the run ends at the write that does not fit: no time to measure from outside

        faulted("the bucket gone for 5 s (connections refused), then stalled (no answer) for longer than the "
                "deadline", gone_briefly_then_stall)
        faulted("the bucket gone (connections refused) for longer than the deadline", until_the_end(stopped))
        faulted("SIGTERM while a checkpoint save is stuck on a stalled bucket", sigterm_in_a_stuck_save)
        faulted("SIGKILL inside a checkpoint save (an upload on its way)", kill_in_a_save)
        room = (len(fs.cat_file("faults/run/metrics.jsonl")) // 4096 + 2) * 4096  # for the staged copy, and a page
        faulted("the cache disk full ($DFLASH_JAX_CACHE on a 1 MiB tmpfs with a page more than the staged "
                "metrics.jsonl needs)", full_cache, lambda command: on_a_full_disk(command, root / "cache", free=room))
        job.start()
        code, _, stderr = job.end()
        assert code == 0, stderr[-3000:]
        steps = [json.loads(line)["step"] for line in fs.cat_file("faults/run/metrics.jsonl").splitlines()]
        assert steps == list(range(1, STEPS + 1)), steps  # each step once
        runs.append([None, code, None, None, None, stderr])

    print(f"Date: {datetime.date.today()}. Machine: {platform.machine()}, {os.cpu_count()} CPU cores; storage "
          f"deadline {DEADLINE:g} s, stop grace {GRACE:g} s, a checkpoint every {EVERY} steps, {STEPS} steps in all; "
          f"the final run finished with every step logged once.\n")
    print("| fault | exit code | last line | time to stop | steps trained again |")
    print("| --- | ---: | --- | ---: | ---: |")
    for (name, code, line, seconds, reached, _), following in zip(runs, runs[1:]):
        again = reached - resumed_from(following[5])  # logged, then lost with the steps after the last checkpoint
        stop = "at the write" if seconds is None else f"{seconds:.1f} s"
        line = "none (killed)" if code == -signal.SIGKILL else f"`{line}`"
        print(f"| {name} | {code} | {line} | {stop} | {again} (steps {resumed_from(following[5]) + 1}-{reached}) |")
    regeneration()


def regeneration() -> None:
    """`regenerate` as two processes (jax.distributed on CPU, four devices each) into a bucket; SIGTERM to
    process 1 once it has written a window; then the rerun that finishes the job."""
    from dflash_jax.regeneration import shares
    from dflash_jax.regeneration.job import WINDOW_BATCHES
    from dflash_jax.regeneration.output import PROGRESS_SUFFIX
    from dflash_jax.runtime.paths import cached_path
    from tests.gcs_fixture import gcs_server
    from tests.process_fixtures import DEVICES_PER_PROCESS, outputs_of, start_two_processes
    from tests.train_fixtures import make_target

    window, out = WINDOW_BATCHES * DEVICES_PER_PROCESS, "gs://faults/out.jsonl"
    with tempfile.TemporaryDirectory() as directory, gcs_server() as fs:
        root = Path(directory)
        os.environ["DFLASH_JAX_CACHE"] = str(root / "cache")
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"Hello world number {i}", "i": i}) + "\n"
                                   for i in range(10 * window)))
        (root / "config.py").write_text(
            "from tests.train_fixtures import tiny_config\n\n\ndef get_config():\n"
            f"    return tiny_config({str(make_target(root / 'target', num_layers=2))!r}, {str(prompts)!r})\n")
        command = [sys.executable, "-m", "dflash_jax.regenerate", f"--config={root / 'config.py'}",
                   f"--prompts={prompts}", f"--batch_size={DEVICES_PER_PROCESS}", "--max_new_tokens=6", "--quiet",
                   f"--out={out}"]
        fs.mkdir("faults")
        progress = cached_path(f"{shares.part_path(out, 1, 2)}{PROGRESS_SUFFIX}")
        processes = start_two_processes(command)
        while not progress.is_file() or json.loads(progress.read_text())["records_done"] < window:
            time.sleep(0.05)
        processes[1].send_signal(signal.SIGTERM)
        began = time.monotonic()
        outputs_of(processes, returncode=75)
        took = time.monotonic() - began
        done = [json.loads(fs.cat_file(f"faults/out.jsonl.part-{p}-of-2{PROGRESS_SUFFIX}"))["records_done"]
                for p in range(2)]
        outputs_of(start_two_processes(command))
        indices = [json.loads(line)["i"] for line in fs.cat_file("faults/out.jsonl").decode().splitlines()]
        assert indices == sorted(set(indices))
    print(f"\n`regenerate` as two processes into a bucket, {10 * window} records, windows of {window} records per "
          f"process: SIGTERM to process 1 after its first window. Both exited with 75 within {took:.1f} s of the "
          f"signal, each part holding {done[0]} and {done[1]} records (whole windows); the rerun of two processes "
          f"finished the job: {len(indices)} records written, each once, in input order.")


if __name__ == "__main__":
    main()
