"""Records, loaders and chats the data tests share, and the same records in every file format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax.data import BatchLoader

from tests.tokenizer_fixture import make_chat_tokenizer


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Write records (dicts become JSON, strings are written verbatim) one per line."""
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


def completion_records(count: int, seed: int = 0, max_words: int = 30) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    words = "the model trains a draft block of tokens for each anchor in the packed row".split()
    return [
        {"prompt": f"Record {i}:", "completion": " " + " ".join(rng.choice(words, rng.integers(1, max_words)))}
        for i in range(count)
    ]


def make_loader(paths: list[Path], **overrides: Any) -> BatchLoader:
    options = dict(seq_len=64, anchor_stride=8, batch_size=4, seed=0)
    options.update(overrides)
    return BatchLoader(paths, make_chat_tokenizer(), **options)


def row_documents(batch: dict[str, np.ndarray], row: int) -> list[dict[str, np.ndarray]]:
    """The per-document slices of one batch row, in order of segment id."""
    segments = batch["segment_ids"][row]
    return [{key: value[row][segments == s] for key, value in batch.items()} for s in np.unique(segments[segments > 0])]


SYSTEM = {"role": "system", "content": "Answer briefly."}


REASONING_CONTENT = [
    SYSTEM,
    {"role": "user", "content": "What is a block?"},
    {"role": "assistant", "content": "A block is a draft.", "reasoning_content": "The user asks about blocks."},
    {"role": "user", "content": "And a row?"},
    {"role": "assistant", "content": "A row is packed.", "reasoning_content": "Rows hold packed documents."},
]


TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."},
]


# Two calls with different arguments: in a table both argument structs get both fields, one of them null.
TWO_CALLS = [TOOL_CHAT[0], {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon", "unit": "C"}}}]},
    *TOOL_CHAT[2:]]


def mixed_records(count: int = 36) -> list[dict]:
    """Completions, chats with reasoning and tool chats: rows of one table with every column, mostly null."""
    records = completion_records(count, seed=3, max_words=40)
    for i in range(0, count, 6):
        records[i] = {"messages": (REASONING_CONTENT, TOOL_CHAT, TWO_CALLS)[i // 6 % 3]}
    return records


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
