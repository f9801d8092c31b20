"""A run in a bucket (fake-gcs-server on loopback, tests/gcs_fixture.py), through the console script with the
command a local run uses: data, target and workdir at gs:// URLs. The reference is the same run on local disk:
the same losses (design §7.1)."""

from __future__ import annotations

import json

import pytest

from tests.command import dflash_jax
from tests.gcs_fixture import gcs_server
from tests.train_fixtures import make_target, write_corpus

TINY = "configs/tiny.py"
SMALL = ("--config.data.seq_len=64", "--config.drafter.sliding_window=24", "--config.log_every=1",
         "--config.mesh.fsdp=1", "--config.total_steps=2")


def train(workdir: str, target: str, corpus: str):
    result = dflash_jax("train", "--config", TINY, "--workdir", workdir, f"--config.target_dir={target}",
                        f"--config.data.train_files={corpus}", *SMALL, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def losses(metrics: str) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    return {record["step"]: record["loss"] for record in records}


@pytest.mark.slow
def test_training_with_data_target_and_workdir_in_a_bucket_matches_the_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))  # the command's copy of the target
    target, corpus = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl", count=40)
    train(str(tmp_path / "run"), str(target), str(corpus))
    with gcs_server() as fs:
        fs.mkdir("dflash")
        fs.put(str(target), "dflash/target", recursive=True)
        fs.put_file(str(corpus), "dflash/train.jsonl")
        train("gs://dflash/run", "gs://dflash/target", "gs://dflash/train.jsonl")
        assert losses(fs.cat_file("dflash/run/metrics.jsonl").decode()) == pytest.approx(
            losses((tmp_path / "run" / "metrics.jsonl").read_text()))
        assert fs.exists("dflash/run/checkpoints/2/commit_success.txt")
        assert fs.exists("dflash/run/drafter_config.json") and not fs.exists("dflash/run/lock.json")
        assert fs.find("dflash/run/tensorboard")
    assert (tmp_path / "cache" / "urls" / "gs" / "dflash" / "target" / "model.safetensors").is_file()
