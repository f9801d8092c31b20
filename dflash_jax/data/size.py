"""The size of a training corpus as the loader draws it: records and tokens per epoch.

For schedules counted in epochs (total steps = epochs x tokens per epoch / tokens per step): `corpus_size`
resolves config.data.train_files as the loader does (data/sources.py), reads and tokenizes every record once
and counts each source `weight` times, as an epoch draws it (data/corpus.py). It reads the whole corpus, so it
costs one tokenization pass (a progress bar shows it); bad records follow `bad_records` as in training.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from dflash_jax.data.corpus import Corpus
from dflash_jax.data.sources import resolve_sources
from dflash_jax.data.tokenize import tokenize_record
from dflash_jax.errors import DataError


@dataclass(frozen=True)
class CorpusSize:
    """Per epoch: records drawn, their tokens, and the tokens among them that are trained (loss_mask = 1)."""

    records: int
    tokens: int
    trained_tokens: int


def corpus_size(paths: Sequence[str | os.PathLike], tokenizer: PreTrainedTokenizerBase, *,
                chat_template_kwargs: dict[str, Any] | None = None, max_positions: int | None = None,
                bad_records: str = "raise") -> CorpusSize:
    """Records and tokens one epoch of the loader draws from `paths` (documents cut to `max_positions`, the
    target's max_position_embeddings, as the loader cuts them)."""
    sources = resolve_sources(paths, "config.data.train_files")
    records = tokens = trained = 0.0
    for source in sources:
        corpus = Corpus([source], row=0, batch_size=1, bad_records=bad_records)
        source_tokens = source_trained = 0
        for index in tqdm(range(len(corpus)), desc=f"counting tokens of {source.source.name}", unit="records"):
            try:
                document = tokenize_record(corpus.read(index), tokenizer, "", chat_template_kwargs)
            except DataError as e:
                corpus.report_bad_record(DataError(corpus.where(index), e.reason))
                continue
            cut = slice(0, max_positions)
            source_tokens += len(document.input_ids[cut])
            source_trained += int(document.loss_mask[cut].sum())
        corpus.close()
        records += corpus.epoch_length
        tokens += source.weight * source_tokens
        trained += source.weight * source_trained
    return CorpusSize(records=int(records), tokens=round(tokens), trained_tokens=round(trained))
