r"""Train a DFlash drafter:

    dflash-jax train --config configs/qwen27b.py --workdir /ckpt/run1 \
        --config.target_dir=/ckpt/Qwen3.6-27B --config.data.train_files=/data/train.jsonl [--config.<key>=<value> ...]

`python -m dflash_jax.train` is the same command. Rerun it with the same --workdir to resume after a stop
(SIGTERM/SIGINT save a checkpoint first). Outputs in the workdir: checkpoints/, metrics.jsonl,
drafter_config.json, config_history.jsonl (runtime/workdir.py). On several hosts, run the same command on each
(see config.distributed and runtime/distributed.py).

Exit codes (docs/failure_handling.md): 0 the run reached config.total_steps; 2 a user error, reported in one
`error:` line; 74 a storage outage, rerun to resume; 75 (EX_TEMPFAIL) stopped by SIGTERM/SIGINT after saving
its checkpoint, rerun to resume (schedulers requeue on it); 76 stopped by SIGTERM/SIGINT, but the stop outlasted
config.stop_grace_seconds: rerun to resume from the last complete checkpoint, which its one line names.
"""

from __future__ import annotations

import logging
import os
import sys

import jax
from absl import flags
from absl import logging as absl_logging

from dflash_jax.commands import cli
from dflash_jax.runtime import distributed
from dflash_jax.train.loop import train, use_compilation_cache

EXIT_STOPPED = os.EX_TEMPFAIL  # 75: stopped by a signal after the checkpoint; rerun the command to resume

FLAGS = flags.FlagValues()  # this command's own flags (cli.py)
_CONFIG = cli.define_config_flag(FLAGS)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, drafter_config.json.",
                               flag_values=FLAGS)
flags.mark_flags_as_required(["config", "workdir"], flag_values=FLAGS)


def main() -> None:
    logging.getLogger("dflash_jax").setLevel(logging.INFO)
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every checkpoint phase at INFO
    config = _CONFIG.value
    distributed.initialize(config.distributed)  # before any other JAX call
    if jax.process_index() > 0:  # process 0 speaks for the run; the others warn, fail, and tell their data
        logging.getLogger("dflash_jax").setLevel(logging.WARNING)
        logging.getLogger("dflash_jax.data").setLevel(logging.INFO)  # each process reads its own share
    use_compilation_cache(config, _WORKDIR.value)
    summary = train(config, _WORKDIR.value)
    if summary["stopped_by"]:
        sys.exit(EXIT_STOPPED)


if __name__ == "__main__":
    cli.run(main, FLAGS)
