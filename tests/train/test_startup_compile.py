"""A start compiles the train step once (design §13.1): where a memory budget makes the run plan its step before
reading any weight, the executable the plan compiled is the one the loop calls, on a fresh start and on a resume.
Counted from JAX's compile log on 8 simulated CPU devices with config.hbm_gib set (and the caller's config is
left as given); also with config.epochs, whose step count is known only once the corpus is counted, after the
plan: the schedule's length is an argument of the step, not a constant of its program."""

from __future__ import annotations

import logging

import jax
import pytest

from dflash_jax.train import loop
from tests.train_fixtures import make_target, tiny_config, write_corpus


class _Compiles(logging.Handler):
    """Counts JAX's "Finished XLA compilation of jit(train_step)" lines."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.train_steps = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Finished XLA compilation of" in message and "jit(train_step)" in message:
            self.train_steps += 1


def _train_counting_compiles(config, workdir, caplog) -> int:
    compiles = _Compiles()
    logging.getLogger("jax").addHandler(compiles)
    previous = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.INFO):
            loop.train(config, workdir)
    finally:
        jax.config.update("jax_log_compiles", previous)
        logging.getLogger("jax").removeHandler(compiles)
    return compiles.train_steps


@pytest.mark.slow  # three tiny runs on 8 simulated devices, each compiling its step (make test-slow)
def test_a_start_with_a_memory_budget_compiles_the_step_once(tmp_path, caplog):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, as make test sets)")
    target, corpus = make_target(tmp_path / "target"), write_corpus(tmp_path / "train.jsonl")
    overrides = {"data.batch_size": 8, "hbm_gib": 4.0, "eval_every": 0, "compilation_cache_dir": "off",
                 "checkpoint_every": 1000}
    config = tiny_config(target, corpus, total_steps=2, **overrides)
    config.mesh.update(data=2, fsdp=4)
    config.loss.terms = "ce"  # one name, which the run's own copy normalises to {"ce": 1.0}
    given = config.to_dict()
    assert _train_counting_compiles(config, tmp_path / "given_steps", caplog) == 1
    assert config.to_dict() == given  # the run settles its own copy: the caller's config is left as given
    assert "plan:" in caplog.text
    caplog.clear()  # a resume runs the plan's executable on the restored state
    config.total_steps = 3
    assert _train_counting_compiles(config, tmp_path / "given_steps", caplog) == 1
    assert "resuming from" in caplog.text and "at step 2" in caplog.text

    caplog.clear()
    config = tiny_config(target, corpus, total_steps=None, epochs=0.01, **overrides)
    config.mesh.update(data=2, fsdp=4)
    assert _train_counting_compiles(config, tmp_path / "epochs", caplog) == 1
    assert "config.epochs = 0.01 over" in caplog.text
