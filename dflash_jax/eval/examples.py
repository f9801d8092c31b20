"""Evaluation examples: (prompt, continuation) token ids from JSONL records, and the target's own greedy
continuations of their prompts (design §9).

A record is tokenized exactly as for training (`data.tokenize_record`); its continuation is the last
trained span (the completion, or the last assistant turn) and its prompt is everything before it. Where the
continuation is generated, a record may also be a prompt alone (`{"prompt"}` without a completion, or a chat
whose last turn is not the assistant's): its prompt is then all of it, a chat with the generation prompt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from transformers import GenerationConfig, PreTrainedTokenizerBase

from dflash_jax.data import CompletionRecord, parse_record, tokenize_prompt, tokenize_record
from dflash_jax.data.records import Record
from dflash_jax.data.corpus import check_input_files
from dflash_jax.runtime.errors import DataError
from dflash_jax.eval.exact_tau import Example
from dflash_jax.eval.generate import SpeculativeGenerator
from dflash_jax.runtime.paths import open_input
from dflash_jax.weights.hub import pretrained_dir


def read_examples(files: Sequence[str | os.PathLike], tokenizer: PreTrainedTokenizerBase, limit: int, *,
                  max_continuation: int | None = None, chat_template_kwargs: dict | None = None,
                  max_positions: int | None = None, generated: int = 0, generate: bool = False) -> list[Example]:
    """The first `limit` records of the JSONL files, in file order; continuations cut to max_continuation.

    max_positions: the target's max_position_embeddings; a prompt whose tokens plus its continuation's (or,
    when `generated` > 0, the tokens to generate after it) exceed it is refused, naming the record (the target
    never saw such positions). generate: the continuations will be generated, so prompt-only records are read
    (with an empty continuation, to be replaced).
    """
    what = "evaluation prompts: --prompts, or config.data.eval_files"
    if not files:
        raise DataError("evaluation prompts", f"no JSONL files given ({what.split(': ')[1]})")
    check_input_files(files, what)
    examples = []
    for path in files:
        with open_input(path) as f:  # decoded line by line, so a non-UTF-8 byte is reported at its line
            for line_number, raw in enumerate(f, start=1):
                if len(examples) == limit:
                    return examples
                where = f"{path}:{line_number}"
                line = _text(raw, where)
                if line.strip():
                    record = parse_record(line, where, prompt_only=generate)
                    if generate and _prompt_only(record):
                        example = Example(tokenize_prompt(record, tokenizer, where, chat_template_kwargs),
                                          np.zeros(0, np.int32))
                    else:
                        document = tokenize_record(record, tokenizer, where, chat_template_kwargs)
                        example = _split(document.input_ids, document.loss_mask, where, max_continuation)
                    check_positions(example, where, generated, max_positions)
                    examples.append(example)
    if not examples:
        raise DataError(", ".join(map(os.fspath, files)), f"no records to evaluate on ({what})")
    return examples


def _prompt_only(record: Record) -> bool:
    """No response to continue from: a raw prompt without completion, or a chat not ending with the assistant."""
    if isinstance(record, CompletionRecord):
        return not record.completion
    return record.messages[-1]["role"] != "assistant"


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(where, f"not UTF-8 text ({error.reason} at byte {error.start} of the line); JSONL files "
                        f"must be UTF-8") from None


def check_positions(example: Example, where: str, generated: int, max_positions: int | None) -> None:
    continuation = generated or len(example.continuation_ids)
    if max_positions is not None and len(example.prompt_ids) + continuation > max_positions:
        raise DataError(where, f"the prompt's {len(example.prompt_ids)} tokens plus {continuation} continuation "
                        f"tokens exceed the target's max_position_embeddings ({max_positions}); use shorter prompts "
                        f"or fewer continuation tokens (--max_new_tokens)")


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
        eos = GenerationConfig.from_pretrained(pretrained_dir(target_dir)).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
