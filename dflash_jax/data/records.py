"""JSONL training records: parsing and validation.

Two record kinds, one JSON object per line:
  {"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}   chat, templated
  {"prompt": "...", "completion": "..."}                                              raw continuation
Every problem is reported as a `DataError` whose message starts with `path:line:`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dflash_jax.errors import DataError


@dataclass(frozen=True)
class ChatRecord:
    """A conversation rendered with the target's chat template; assistant turns are trained."""

    # Message dicts are passed to the chat template as given, so extra keys (e.g. reasoning_content) reach it.
    messages: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class CompletionRecord:
    """Raw text: `prompt` is context only, `completion` is trained. No chat template, no special tokens."""

    prompt: str
    completion: str


Record = ChatRecord | CompletionRecord


def parse_record(line: bytes | str, where: str) -> Record:
    """Parse and validate one JSONL line. Raises DataError(where, reason) on any problem."""
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(where, f"invalid UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(where, f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise DataError(where, f"expected a JSON object, got {type(obj).__name__}")
    has_chat, has_completion = "messages" in obj, ("prompt" in obj or "completion" in obj)
    if has_chat and has_completion:
        raise DataError(where, "record has both 'messages' and 'prompt'/'completion'; use one kind")
    if has_chat:
        return _parse_chat(obj["messages"], where)
    if has_completion:
        return _parse_completion(obj, where)
    raise DataError(where, f"record needs 'messages' or 'prompt' + 'completion'; found keys {sorted(obj)}")


def _parse_chat(messages: Any, where: str) -> ChatRecord:
    if not isinstance(messages, list) or not messages:
        raise DataError(where, "'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise DataError(where, f"{field} must be an object, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise DataError(where, f"{field} is missing '{key}'")
            if not isinstance(message[key], str):
                raise DataError(where, f"{field}.{key} must be a string, got {type(message[key]).__name__}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(where, "conversation has no assistant turn, so nothing would be trained")
    return ChatRecord(messages=tuple(messages))


def _parse_completion(obj: dict[str, Any], where: str) -> CompletionRecord:
    for key in ("prompt", "completion"):
        if key not in obj:
            raise DataError(where, f"record is missing '{key}'")
        if not isinstance(obj[key], str):
            raise DataError(where, f"'{key}' must be a string, got {type(obj[key]).__name__}")
    if not obj["completion"]:
        raise DataError(where, "'completion' is empty, so nothing would be trained")
    return CompletionRecord(prompt=obj["prompt"], completion=obj["completion"])
