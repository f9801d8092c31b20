"""Full local disks (design §7.2): the local copies a command stages for a bucket (metrics.jsonl,
regenerate's output, an export) running out of space give one line naming the directory, and the bucket
keeps everything uploaded before, whole.

The commands run on a disk that is really full: a 1 MiB tmpfs, nearly filled, mounted over the cache or staging
directory in a mount namespace of their own (`unshare --user --map-root-user --mount`, which needs no privilege
where user namespaces are enabled). The unit test injects the error at the OS boundary instead (`os.pwrite`
failing with ENOSPC), to check regenerate's output in one process."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_jax.regeneration import output
from dflash_jax.regeneration.output import PROGRESS_SUFFIX, ResumableJsonl
from dflash_jax.runtime.errors import DiskFullError
from dflash_jax.runtime.paths import cached_path
from tests.gcs_fixture import gcs_server
from tests.process_fixtures import on_a_full_disk
from tests.train_fixtures import make_target, write_corpus

REPO = Path(__file__).resolve().parents[2]


def test_an_output_that_does_not_fit_leaves_the_bucket_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(output, "UPLOAD_EVERY_S", 0.0)  # every append uploaded
    url = "gs://regen/out.jsonl"
    with gcs_server() as fs:
        fs.mkdir("regen")
        writer = ResumableJsonl(url, {"seed": 0})
        writer.append([{"n": 0}, {"n": 1}], records_consumed=2)
        uploaded = fs.cat_file("regen/out.jsonl"), fs.cat_file(f"regen/out.jsonl{PROGRESS_SUFFIX}")

        def full(descriptor, data, offset):  # the first bytes fit, then the disk is full
            os.write(descriptor, bytes(data[:3]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(DiskFullError, match=rf"^{re.escape(str(cached_path(url).parent))}: no space left on its "
                                                r"disk .* while writing the local copy of gs://regen/out.jsonl; free "
                                                r"space there \(or set DFLASH_JAX_CACHE to a directory with room\)"):
            writer.append([{"n": 2}], records_consumed=1)
        assert (writer.records_done, writer.lines) == (2, 2)
        writer.close()  # what a command does on its way out: the store's output and progress stay consistent
        monkeypatch.undo()
        monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
        assert json.loads(fs.cat_file(f"regen/out.jsonl{PROGRESS_SUFFIX}")) == json.loads(uploaded[1])
        assert fs.cat_file("regen/out.jsonl").startswith(uploaded[0])
        resumed = ResumableJsonl(url, {"seed": 0})
        resumed.append([{"n": 2}], records_consumed=1)
        resumed.close()
        assert fs.cat_file("regen/out.jsonl") == uploaded[0] + b'{"n": 2}\n'


@pytest.fixture(scope="module")
def namespaces():
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs `unshare` and user namespaces, which this machine does not allow")


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow  # four commands: about a minute on 2 shared cores (make test-slow)
def test_a_full_cache_or_staging_disk_is_one_line_and_the_bucket_loses_nothing(tmp_path, monkeypatch, namespaces):
    target, corpus = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl")
    cache, steps = tmp_path / "cache", 12
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(cache))

    def train() -> list[str]:
        return [sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs" / "tiny.py"),
                "--workdir", "gs://dflash/run", f"--config.target_dir={target}", f"--config.data.train_files={corpus}",
                "--config.data.seq_len=64", "--config.drafter.block_size=8", "--config.drafter.sliding_window=24",
                "--config.mesh.fsdp=1", "--config.log_every=1", "--config.checkpoint_every=1",
                f"--config.total_steps={steps}"]

    def export(out: str) -> list[str]:
        return [sys.executable, "-m", "dflash_jax.export", "--workdir", "gs://dflash/run", "--out", out, "--overwrite"]

    with gcs_server() as fs:  # STORAGE_EMULATOR_HOST reaches the commands through the environment
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
                   JAX_COMPILATION_CACHE_DIR=str(tmp_path / "compile_cache"), PYTHONPATH=str(REPO))
        fs.mkdir("dflash")
        full = subprocess.run(on_a_full_disk(train(), cache, free=4096), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=900)
        where = cached_path("gs://dflash/run/metrics.jsonl").parent
        assert re.fullmatch(rf"error: {re.escape(str(where))}: no space left on its disk .*; "
                            r"free space there \(or set DFLASH_JAX_CACHE to a directory with room\) and rerun the "
                            r"same command: what was saved before is kept", one_line(full)), full.stderr[-3000:]
        logged = [json.loads(line)["step"] for line in fs.cat_file("dflash/run/metrics.jsonl").splitlines()]
        assert logged == list(range(1, len(logged) + 1)) and 1 < len(logged) < steps  # whole records, each once

        rerun = subprocess.run(train(), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        logged = [json.loads(line)["step"] for line in fs.cat_file("dflash/run/metrics.jsonl").splitlines()]
        assert logged == list(range(1, steps + 1))
        assert fs.exists(f"dflash/run/checkpoints/{steps}/commit_success.txt")

        done = subprocess.run(export("gs://dflash/drafter"), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        exported = {path: fs.cat_file(path) for path in fs.find("dflash/drafter")}
        staging = tmp_path / "staging"
        full = subprocess.run(on_a_full_disk(export("gs://dflash/drafter"), staging, free=4096), cwd=REPO,
                              env=dict(env, TMPDIR=str(staging)), capture_output=True, text=True, timeout=600)
        assert re.fullmatch(rf"error: {re.escape(str(staging))}/dflash_jax-output-\S+: no space left on its disk .* "
                            r"while writing the output for gs://dflash/drafter; free space there \(or set TMPDIR to a "
                            r"directory with room\) and rerun the same command: what was saved before is kept",
                            one_line(full)), full.stderr[-3000:]
        assert {path: fs.cat_file(path) for path in fs.find("dflash/drafter")} == exported  # the earlier export whole
