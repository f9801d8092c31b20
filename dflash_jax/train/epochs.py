"""`config.epochs`: the schedule's length from the corpus (design §7), and the data progress logged each log step.

A step takes `batch_size` rows of `seq_len - (anchor_stride - 1)` content tokens (data/packing.py), so E epochs
over a corpus of C tokens are ceil(E · C / tokens per step) steps. That is the number of steps whose rows could
hold E passes over the corpus; packing leaves some padding, so the passes they actually make are a little
fewer, and the logged `epoch` (records begun / records) says how many.

The corpus is counted once, by tokenizing every record (each process counts its own rows' shares and the counts
are summed), and the count is kept in <workdir>/corpus_tokens.json: a resumed run reads it back instead of
counting again, so it keeps the same total (the workdir's loader state already pins the corpus).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from etils import epath
from ml_collections import ConfigDict

from dflash_jax.data import BatchLoader, row_capacity
from dflash_jax.runtime import distributed
from dflash_jax.train.config import anchor_grid

log = logging.getLogger(__name__)

CORPUS_TOKENS_FILE = "corpus_tokens.json"


def tokens_per_step(config: ConfigDict) -> int:
    """Content tokens the rows of one step hold."""
    return config.data.batch_size * row_capacity(config.data.seq_len, anchor_grid(config).stride)


def steps_for_epochs(epochs: float, corpus_tokens: int, step_tokens: int) -> int:
    return max(1, math.ceil(epochs * corpus_tokens / step_tokens))


def total_steps(config: ConfigDict, workdir: epath.Path, loader: BatchLoader, main: bool) -> int:
    """config.total_steps when given (it takes precedence); else, with config.epochs, the steps of that many
    passes over the loader's corpus (the warmup ratio and the cosine then follow it). Every process calls it (it
    may gather counts); before the loader's first batch."""
    if config.total_steps is not None:
        return config.total_steps
    tokens = _corpus_tokens(workdir, loader, main)
    step_tokens = tokens_per_step(config)
    steps = steps_for_epochs(config.epochs, tokens, step_tokens)
    log.info("config.epochs = %g over %d corpus tokens at %d tokens a step: total_steps = %d", config.epochs,
             tokens, step_tokens, steps)
    return steps


def _corpus_tokens(workdir: epath.Path, loader: BatchLoader, main: bool) -> int:
    path = workdir / CORPUS_TOKENS_FILE
    saved = json.loads(path.read_text()) if path.exists() else None
    usable = saved is not None and saved.get("corpus_bytes") == loader.corpus_bytes
    if all(distributed.process_flags(usable)):  # every process reads the same count back
        return int(saved["tokens"])
    log.info("counting the corpus's tokens for config.epochs (one tokenization pass)")
    tokens = sum(distributed.gather_json(loader.corpus_tokens()))
    if main:
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps({"corpus_bytes": loader.corpus_bytes, "tokens": tokens}) + "\n")
        partial.replace(path)
    return tokens


def data_progress(positions: Sequence[dict[str, Any]]) -> dict[str, float]:
    """records_seen (records begun, over every row) and epoch (records_seen / the corpus's records) from the
    loader positions of every process (`BatchLoader.state()`, after the same batch)."""
    seen = records = 0
    for position in positions:
        for row in position["rows"].values():
            seen += row["epoch"] * row["records"] + row["document"]
            records += row["records"]
    return {"records_seen": seen, "epoch": seen / records}
