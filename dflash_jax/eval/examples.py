"""Evaluation examples: (prompt, continuation) token ids from JSONL records, and the target's own greedy
continuations of their prompts (design §9).

A record is tokenized exactly as for training (`data.tokenize_record`); its continuation is the last
trained span (the completion, or the last assistant turn) and its prompt is everything before it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from transformers import GenerationConfig, PreTrainedTokenizerBase

from dflash_jax.data import parse_record, tokenize_record
from dflash_jax.errors import DataError
from dflash_jax.eval.exact_tau import Example
from dflash_jax.eval.generate import SpeculativeGenerator


def read_examples(files: Sequence[str | os.PathLike], tokenizer: PreTrainedTokenizerBase, limit: int, *,
                  max_continuation: int | None = None, chat_template_kwargs: dict | None = None) -> list[Example]:
    """The first `limit` records of the JSONL files, in file order; continuations cut to max_continuation."""
    if not files:
        raise DataError("evaluation prompts", "no JSONL files given (--prompts, or config.data.eval_files)")
    examples = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if len(examples) == limit:
                    return examples
                if line.strip():
                    where = f"{path}:{line_number}"
                    document = tokenize_record(parse_record(line, where), tokenizer, where, chat_template_kwargs)
                    examples.append(_split(document.input_ids, document.loss_mask, where, max_continuation))
    return examples


def _split(input_ids: np.ndarray, loss_mask: np.ndarray, where: str, max_continuation: int | None) -> Example:
    trained = np.flatnonzero(loss_mask)
    if trained.size == 0:
        raise DataError(where, "the record has no trained tokens to use as the continuation")
    end = trained[-1] + 1
    gaps = np.flatnonzero(np.diff(trained) > 1)  # the last trained span starts after the last gap
    start = trained[gaps[-1] + 1] if gaps.size else trained[0]
    if start == 0:
        raise DataError(where, "the continuation starts at the first token, so there is no prompt")
    if max_continuation is not None:
        end = min(end, start + max_continuation)
    return Example(np.asarray(input_ids[:start], np.int32), np.asarray(input_ids[start:end], np.int32))


def with_greedy_continuations(generator: SpeculativeGenerator, examples: Sequence[Example], max_new_tokens: int,
                              stop_token_ids: Sequence[int]) -> list[Example]:
    """The same prompts, each continued by the target's own greedy decoding (generator without a drafter)."""
    return [Example(e.prompt_ids, generator.generate(e.prompt_ids, max_new_tokens, stop_token_ids).tokens)
            for e in examples]


def stop_token_ids(target_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The target's end-of-generation ids: generation_config.json's eos_token_id, else the tokenizer's eos."""
    try:
        eos = GenerationConfig.from_pretrained(target_dir).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
