"""config.epochs (train/epochs.py): the step count a hand count of the toy corpus gives, the schedule that follows
it, the epoch and records logged, and a resume that keeps the count without counting again (on a batch given
as rows per device)."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
from etils import epath
from transformers import AutoTokenizer

from configs import toy
from dflash_jax.data import BatchLoader
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.train import epochs, validate
from dflash_jax.train.loop import train
from dflash_jax.train.optimizer import learning_rate_schedule
from dflash_jax.runtime.workdir import METRICS_FILE
from tests.train_fixtures import make_target, tiny_config, write_corpus


def test_epochs_of_the_toy_corpus_take_the_steps_a_hand_count_gives(tmp_path):
    config = toy.get_config()
    config.total_steps, config.epochs = None, 2.5
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    records = [json.loads(line) for line in open(config.data.train_files[0])]
    # The toy records are prompt/completion pairs, tokenized apart without special tokens (data/tokenize.py).
    corpus_tokens = sum(len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"])
                        + len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) for r in records)
    row_content = config.data.seq_len - (config.data.anchor_stride - 1)  # 321 tokens after the phase room
    expected = math.ceil(2.5 * corpus_tokens / (config.data.batch_size * row_content))

    loader = BatchLoader(config.data.train_files, tokenizer, seq_len=config.data.seq_len,
                         anchor_stride=config.data.anchor_stride, batch_size=config.data.batch_size)
    assert epochs.total_steps(config, epath.Path(tmp_path), loader, main=True) == expected
    assert json.loads((tmp_path / epochs.CORPUS_TOKENS_FILE).read_text())["tokens"] == corpus_tokens
    warmup = round(config.optim.warmup_ratio * expected)  # warmup and cosine follow the derived total
    schedule = learning_rate_schedule(config, expected)
    assert float(schedule(warmup)) == pytest.approx(config.optim.learning_rate)
    assert float(schedule(expected)) == 0.0 and float(schedule(expected - 1)) > 0.0


@pytest.mark.parametrize("overrides, message", [
    ({"total_steps": None}, "give config.total_steps or config.epochs"),
    ({"total_steps": None, "epochs": 0.0}, "config.epochs must be > 0"),
])
def test_the_schedule_needs_total_steps_or_epochs(overrides, message):
    config = toy.get_config()
    for key, value in overrides.items():
        config[key] = value
    with pytest.raises(ConfigError, match=message):
        validate.validate_config(config)


def test_given_total_steps_take_precedence_over_epochs(tmp_path, caplog):
    """A short run of a recipe in epochs (`--config.total_steps=N`: the command line cannot unset epochs)."""
    config = toy.get_config()
    config.epochs = 6.0
    validate.validate_config(config)
    assert "config.total_steps = 1467 takes precedence over config.epochs = 6" in caplog.text
    assert epochs.total_steps(config, epath.Path(tmp_path), loader=None, main=True) == 1467


# slow: a stopped and a resumed train command (make test's budget); the step count itself is in make test
@pytest.mark.slow
def test_a_resumed_epochs_run_keeps_its_step_count_and_logs_its_epoch(tmp_path, monkeypatch):
    config = tiny_config(make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl", count=60),
                         total_steps=None, epochs=0.8, log_every=1, checkpoint_every=2, eval_every=2,
                         **{"data.batch_size": None, "data.rows_per_device": 4})  # 4 rows on the 1-device mesh

    def stop_at_2(step, drafter, target):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    first = train(config, tmp_path / "run", evaluate=stop_at_2)
    assert (first["final_step"], first["stopped_by"]) == (2, "SIGTERM")
    total = json.loads((tmp_path / "run" / epochs.CORPUS_TOKENS_FILE).read_text())["tokens"]
    steps = epochs.steps_for_epochs(0.8, total, 4 * (64 - 7))  # 4 rows of 64 - (8 - 1) content tokens
    assert steps > 3

    def no_recount(self):
        raise AssertionError("a resume counts the corpus again")

    monkeypatch.setattr(BatchLoader, "corpus_tokens", no_recount)
    second = train(config, tmp_path / "run", evaluate=lambda *_: {})
    assert (second["start_step"], second["final_step"]) == (2, steps)
    records = [json.loads(line) for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    assert logged[-1]["learning_rate"] == pytest.approx(float(learning_rate_schedule(config, steps)(steps - 1)))
    seen = [r["records_seen"] for r in logged]
    assert seen == sorted(seen) and seen[0] >= 4  # each of the 4 rows has begun a record
    assert logged[-1]["epoch"] == pytest.approx(seen[-1] / 60)
