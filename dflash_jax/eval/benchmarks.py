"""The benchmarks of the published DFlash and DDTree tables (design §9.6), their prompts built as z-lab's
benchmark.py builds them (z-lab/dflash on GitHub, dflash/benchmark.py) and Alpaca's, which only DDTree's table
has, as DDTree's benchmark does (liranringel/ddtree, model/utils.py and benchmark.py), and a long-context suite
(LongBench-E style: a long document and a question), whose τ is best read by context length (design §9.7).

A benchmark is a dataset split read with `datasets` (its Hub id's snapshot in the local Hugging Face cache, never
downloaded here, or a local copy) and a rule that makes each row's user turns: one turn, or mt-bench's two. When
the split has more rows than the sample count (128: z-lab's README, DDTree's run_benchmark.sh), both shuffle
with seed 0 and keep the first rows: z-lab with Python's `random` (its transformers backend, the one that reports
τ per response and its histogram as this project does, seeds 0 and then shuffles the list of rows), DDTree with
`Dataset.shuffle(seed=0)`. Each turn is one response: the conversation so far (the earlier turns and the
target's answers to them, decoded without special tokens) goes through the chat template with the generation
prompt, `tokenizer.encode` makes its ids, and the target's greedy continuation is the answer.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_jax.data.sources import (SAVED_DATASET_FILES, cached_dataset, load_dataset, looks_like_dataset_id,
                                     saved_dataset)
from dflash_jax.data.tokenize import render_chat
from dflash_jax.runtime.errors import ConfigError, DataError
from dflash_jax.eval.examples import check_positions
from dflash_jax.eval.exact_tau import Example
from dflash_jax.eval.generate import SpeculativeGenerator, generator_shapes

SAMPLES = 128
SEED = 0
_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."  # z-lab's math suffix
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


def zlab_rows(count: int, limit: int) -> list[int]:
    """The rows z-lab's benchmark.py evaluates: all in order if they fit, else the first `limit` of the list
    shuffled by `random.seed(0); random.shuffle(rows)` (the permutation depends on the length only)."""
    rows = list(range(count))
    if count > limit:
        random.Random(SEED).shuffle(rows)
    return rows[:limit]


def ddtree_rows(count: int, limit: int) -> list[int]:
    """The rows DDTree's benchmark evaluates: all in order if they fit, else the first `limit` of
    `Dataset.shuffle(seed=0)`, whose order is numpy's default_rng(0) permutation."""
    if count <= limit:
        return list(range(count))
    return np.random.default_rng(SEED).permutation(count)[:limit].tolist()


# LongBench / LongBench-E (THUDM/LongBench, arXiv 2308.14508): each row a long document (`context`) and a
# question on it (`input`). The suite's per-subset instructions are not reproduced: one plain wording for every
# subset, since what is measured is drafting against the long document, not the answer's grading.
_LONGBENCH = "Read the document and answer the question after it briefly.\n\n{context}\n\nQuestion: {input}"


def _alpaca(row: dict) -> list[str]:
    return [f"{row['instruction']}\n\nInput:\n{row['input']}" if row["input"] else row["instruction"]]


@dataclass(frozen=True)
class Benchmark:
    dataset_id: str
    config_name: str | None  # the repo's config, where it has several
    split: str
    columns: tuple[str, ...]  # the fields the turns are made of: strings, or (multi_turn) lists of strings
    turns: Callable[[dict], list[str]]  # a row's user turns
    rows: Callable[[int, int], list[int]]  # (rows in the split, samples) -> the rows evaluated, in order
    multi_turn: bool = False


BENCHMARKS = {
    "gsm8k": Benchmark("openai/gsm8k", "main", "test", ("question",),
                       lambda row: [row["question"] + _REASON], zlab_rows),
    "math500": Benchmark("HuggingFaceH4/MATH-500", None, "test", ("problem",),
                         lambda row: [row["problem"] + _REASON], zlab_rows),
    "humaneval": Benchmark("openai/openai_humaneval", None, "test", ("prompt",),
                           lambda row: [_HUMANEVAL.format(row["prompt"])], zlab_rows),
    "mbpp": Benchmark("google-research-datasets/mbpp", "sanitized", "test", ("prompt",),
                      lambda row: [row["prompt"]], zlab_rows),
    "mt-bench": Benchmark("HuggingFaceH4/mt_bench_prompts", None, "train", ("prompt",),
                          lambda row: list(row["prompt"]), zlab_rows, multi_turn=True),
    "alpaca": Benchmark("tatsu-lab/alpaca", None, "train", ("instruction", "input"), _alpaca, ddtree_rows),
    # A subset's JSONL as the suite publishes it (e.g. longbench=data/qasper_e.jsonl), or its cached config.
    "longbench": Benchmark("THUDM/LongBench", None, "test", ("context", "input"),
                           lambda row: [_LONGBENCH.format(**row)], zlab_rows),
}


@dataclass
class Suite:
    """One benchmark's sampled conversations (each a list of user turns) and where they were read."""

    name: str
    source: str
    rows: list[int]  # the dataset rows the conversations come from, for messages
    conversations: list[list[str]]

    def where(self, index: int) -> str:
        return f"--benchmark {self.name}: {self.source} row {self.rows[index]}"


def read_benchmarks(entries: Sequence[str], samples: int = SAMPLES) -> list[Suite]:
    """`NAME` or `NAME=SOURCE` per entry (SOURCE: a JSONL/JSON/Parquet file, a `save_to_disk` directory, a dataset
    repository's files, or another Hub id in the cache); at most `samples` conversations each."""
    parsed = [entry.partition("=")[::2] for entry in entries]
    names = [name for name, _ in parsed]
    for name in names:
        if name not in BENCHMARKS:
            raise ConfigError(f"--benchmark: unknown benchmark {name!r}; the benchmarks are {', '.join(BENCHMARKS)}")
    if len(set(names)) < len(names):
        raise ConfigError(f"--benchmark names a benchmark twice: {', '.join(entries)}")
    if samples < 1:
        raise ConfigError(f"--num_prompts (samples per benchmark) must be >= 1, got {samples}")
    return [_read(name, source or None, samples) for name, source in parsed]


def _read(name: str, source: str | None, samples: int) -> Suite:
    spec = BENCHMARKS[name]
    what = f"--benchmark {name}; a local copy is named as {name}=PATH"
    dataset, described = _dataset(spec, source, what)
    missing = [column for column in spec.columns if column not in dataset.column_names]
    if missing:
        raise DataError(described, f"no column {', '.join(map(repr, missing))} ({name} rows have the columns of "
                                   f"{spec.dataset_id}; this dataset has {dataset.column_names}) ({what})")
    rows = spec.rows(len(dataset), samples)
    suite = Suite(name, described, rows, [])
    for index, row in enumerate(dataset.select(rows).select_columns(list(spec.columns))):
        for column in spec.columns:
            _check_field(row[column], spec.multi_turn, f"{suite.where(index)}, column {column!r}")
        suite.conversations.append(spec.turns(row))
    if not suite.conversations:
        raise DataError(described, f"no rows ({what})")
    return suite


def _dataset(spec: Benchmark, source: str | None, what: str) -> tuple[Any, str]:
    """(the split as a `datasets.Dataset`, its name in messages)."""
    source = source or spec.dataset_id
    if os.path.isdir(source):
        if any(os.path.exists(os.path.join(source, name)) for name in SAVED_DATASET_FILES):
            return saved_dataset(source, spec.split, what)
        return load_dataset(f"{source}:{spec.split}", what, source, spec.config_name, split=spec.split), source
    if os.path.isfile(source):  # one file holds one split
        builder = "parquet" if source.endswith(".parquet") else "json"
        return load_dataset(source, what, builder, data_files=source, split="train"), source
    if looks_like_dataset_id(source):
        return cached_dataset(source, spec.split, what, spec.config_name), f"{source}:{spec.split}"
    raise DataError(source, f"no such file or directory ({what})")


def _check_field(value: Any, multi_turn: bool, where: str) -> None:
    if multi_turn:
        if not (isinstance(value, list) and value and all(isinstance(turn, str) for turn in value)):
            raise DataError(where, f"must be a list of strings (the user turns), got {value!r:.100}")
    elif not isinstance(value, str):
        raise DataError(where, f"must be a string, got {value!r:.100}")


def template_kwargs(config_kwargs: dict | None) -> dict:
    """z-lab passes enable_thinking (False unless --enable-thinking) to the chat template; the config's
    data.chat_template_kwargs, the drafter's training setting, override it."""
    return {"enable_thinking": False, **(config_kwargs or {})}


def turn_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict], kwargs: dict, where: str) -> np.ndarray:
    """The ids of the conversation so far plus the generation prompt: the chat template's text, then
    `tokenizer.encode` (with the special tokens the tokenizer adds, as z-lab's benchmark.py)."""
    text = render_chat(tokenizer, messages, where, kwargs, add_generation_prompt=True)
    return np.asarray(tokenizer.encode(text), np.int32)


def first_turn_lengths(suites: Sequence[Suite], tokenizer: PreTrainedTokenizerBase, kwargs: dict,
                       max_new_tokens: int, max_positions: int | None) -> list[int]:
    """Every conversation's first prompt length, each checked to fit with max_new_tokens in the target's
    positions: the checks that need no model, done before any weights load."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the benchmarks' prompts are chat conversations, and the target's tokenizer has no chat "
                          "template")
    lengths = []
    for suite in suites:
        for index, turns in enumerate(suite.conversations):
            prompt = turn_prompt(tokenizer, [{"role": "user", "content": turns[0]}], kwargs, suite.where(index))
            check_positions(Example(prompt, prompt[:0]), suite.where(index), max_new_tokens, max_positions)
            lengths.append(len(prompt))
    return lengths


def answered_turns(suite: Suite, tokenizer: PreTrainedTokenizerBase, kwargs: dict,
                   answer: Callable[[np.ndarray], np.ndarray], max_new_tokens: int,
                   max_positions: int | None) -> list[Example]:
    """Every turn of every conversation as (its prompt, `answer`'s continuation of it), in order; a turn's prompt
    holds the earlier turns and their answers, decoded without special tokens (z-lab's benchmark.py)."""
    examples = []
    for index, turns in enumerate(suite.conversations):
        messages = []
        for number, turn in enumerate(turns, start=1):
            where = f"{suite.where(index)}, turn {number}"
            messages.append({"role": "user", "content": turn})
            prompt = turn_prompt(tokenizer, messages, kwargs, where)
            check_positions(Example(prompt, prompt[:0]), where, max_new_tokens, max_positions)
            continuation = answer(prompt)
            examples.append(Example(prompt, continuation))
            messages.append({"role": "assistant", "content": tokenizer.decode(continuation, skip_special_tokens=True)})
    return examples


class GreedyAnswers:
    """The target's greedy continuation of a prompt (at most max_new_tokens, ending at a stop token), by plain
    decoding with a generator sized for the longest prompt so far; a later turn's prompt holds the earlier
    answers, so one that does not fit gets a larger generator."""

    def __init__(self, target, max_new_tokens: int, stop_token_ids: Sequence[int], longest_prompt: int):
        self._target, self._max_new_tokens, self._stops = target, max_new_tokens, stop_token_ids
        self._generator = self._sized(longest_prompt)

    def _sized(self, prompt_length: int) -> SpeculativeGenerator:
        return SpeculativeGenerator(self._target, None, **generator_shapes([prompt_length], self._max_new_tokens, 1))

    def __call__(self, prompt_ids: np.ndarray) -> np.ndarray:
        if len(prompt_ids) > self._generator.prefill_len:
            self._generator = self._sized(len(prompt_ids))
        return self._generator.generate(prompt_ids, self._max_new_tokens, self._stops).tokens
