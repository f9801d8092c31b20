"""Train a DFlash drafter:

    python -m dflash_jax.train --config configs/qwen27b.py --workdir /ckpt/run1 \
        --config.target_dir=/ckpt/Qwen3.6-27B --config.data.train_files=/data/train.jsonl [--config.<key>=<value> ...]

Rerun the same command with the same --workdir to resume after a stop (SIGTERM/SIGINT save a checkpoint
first). Outputs in the workdir: checkpoints/, metrics.jsonl, drafter_config.json, config.json.
On several hosts, run the same command on each (see config.distributed and train/distributed.py).
"""

from __future__ import annotations

import logging
import sys

import jax
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from dflash_jax.errors import CheckpointError, ConfigError, DataError
from dflash_jax.eval.train_hook import make_train_evaluator
from dflash_jax.train import distributed
from dflash_jax.train.loop import train, use_compilation_cache
from dflash_jax.train.validate import exit_on_unknown_overrides, validate_config, validate_eval_files

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file under configs/ (e.g. configs/tiny.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, drafter_config.json.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.getLogger("dflash_jax").setLevel(logging.INFO)
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every checkpoint phase at INFO
    config = _CONFIG.value
    try:
        distributed.initialize(config.distributed)  # before any other JAX call
        if jax.process_index() > 0:  # process 0 speaks for the run; the others warn, fail, and tell their data
            logging.getLogger("dflash_jax").setLevel(logging.WARNING)
            logging.getLogger("dflash_jax.data").setLevel(logging.INFO)  # each process reads its own share
        validate_config(config)
        validate_eval_files(config)
        # Exact τ on config.data.eval_files every config.eval_every steps (design §9), logged as eval/* metrics.
        evaluate = make_train_evaluator(config) if config.eval_every else None
        use_compilation_cache(config, _WORKDIR.value)
        train(config, _WORKDIR.value, evaluate=evaluate)
    except (ConfigError, DataError, CheckpointError) as error:  # a bad setup is a sentence, not a traceback
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    exit_on_unknown_overrides(sys.argv[1:])
    app.run(main)
