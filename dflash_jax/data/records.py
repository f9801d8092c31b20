"""Training records: what one record of a data source may hold, validated and normalised.

A record (a JSONL line, or a row of a Parquet file or Hugging Face dataset) is one of:
  {"messages": [{"role", "content", ...}, ...], ["tools": [...]]}   OpenAI chat, rendered with the chat template
  {"conversations": [{"from", "value"}, ...], ["tools": [...]]}      ShareGPT chat, the same once roles are mapped
  {"prompt": "...", "completion": "..."}                              raw continuation
OpenAI messages: `content` is a string, a list of text parts ({"type": "text", "text": ...}) or null beside
`tool_calls`; assistant messages may carry `reasoning_content` and `tool_calls` (their `arguments` a JSON object
or a string holding one), tool messages `tool_call_id`/`name`; they reach the chat template as the OpenAI
chat API and vLLM pass them. Keys whose value is null are dropped (table rows give every message every column).
A `prompt` beside a chat is ignored (Hugging Face chat datasets such as UltraChat carry the first query there).
Every problem is reported as a `DataError` whose message starts with the record's `path:line` or `path row N`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dflash_jax.runtime.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names -> chat roles (FastChat's "human"/"gpt"; "user"/"assistant" are also seen).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool"}
_MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


@dataclass(frozen=True)
class ChatRecord:
    """A conversation rendered with the target's chat template; assistant turns are trained."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class CompletionRecord:
    """Raw text: `prompt` is context only, `completion` is trained. No chat template, no special tokens."""

    prompt: str
    completion: str


Record = ChatRecord | CompletionRecord


def parse_record(line: bytes | str, where: str, prompt_only: bool = False) -> Record:
    """Parse and validate one JSONL line. Raises DataError(where, reason) on any problem. prompt_only: a
    `prompt` record may come without its completion (read as an empty one) and a chat without an assistant
    turn, for a continuation that is generated rather than trained."""
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(where, f"invalid UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(where, f"invalid JSON: {e}") from None
    return parse_object(obj, where, prompt_only)


def parse_object(obj: Any, where: str, prompt_only: bool = False) -> Record:
    """Validate one decoded record (a JSON object or a table row as a dict); prompt_only as in `parse_record`."""
    if not isinstance(obj, dict):
        raise DataError(where, f"expected a JSON object, got {type(obj).__name__}")
    obj = {key: value for key, value in obj.items() if value is not None}
    chats = [key for key in ("messages", "conversations") if key in obj]
    if len(chats) > 1:
        raise DataError(where, "record has both 'messages' and 'conversations'; use one")
    if chats and "completion" in obj:
        raise DataError(where, f"record has both '{chats[0]}' and 'completion'; use one kind")
    if chats:
        messages = obj[chats[0]]
        if chats[0] == "conversations":
            messages = _sharegpt_messages(messages, where)
        return ChatRecord(messages=_chat_messages(messages, where, prompt_only),
                          tools=_tools(obj.get("tools"), where))
    if prompt_only and "prompt" in obj and "completion" not in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise DataError(where, "'prompt' must be a non-empty string")
        return CompletionRecord(prompt=obj["prompt"], completion="")
    if "prompt" in obj or "completion" in obj:
        return _parse_completion(obj, where)
    raise DataError(where, "record needs 'messages', 'conversations' or 'prompt' + 'completion'; found keys "
                           f"{sorted(obj)}")


def _sharegpt_messages(conversations: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(conversations, list) or not conversations:
        raise DataError(where, "'conversations' must be a non-empty list of {'from', 'value'} objects")
    messages = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or "value" not in turn:
            raise DataError(where, f"conversations[{i}] must be an object with a string 'from' and a 'value'")
        if turn["from"] not in SHAREGPT_ROLES:
            raise DataError(where, f"conversations[{i}].from is {turn['from']!r}; expected one of "
                                   f"{sorted(SHAREGPT_ROLES)}")
        extra = {key: turn[key] for key in _MESSAGE_KEYS[2:] if turn.get(key) is not None}
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"], **extra})
    return messages


def _chat_messages(messages: Any, where: str, prompt_only: bool = False) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise DataError(where, "'messages' must be a non-empty list of {'role', 'content'} objects")
    normalised = []
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise DataError(where, f"{field} must be an object, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        if not isinstance(message.get("role"), str):
            raise DataError(where, f"{field} is missing 'role'" if "role" not in message
                            else f"{field}.role must be a string, got {type(message['role']).__name__}")
        if message["role"] not in ROLES:
            raise DataError(where, f"{field}.role is {message['role']!r}; expected one of {list(ROLES)}")
        if "content" not in message and not message.get("tool_calls"):
            raise DataError(where, f"{field} is missing 'content'")
        message["content"] = _text(message.get("content", ""), where, f"{field}.content")
        if "reasoning_content" in message and not isinstance(message["reasoning_content"], str):
            raise DataError(where, f"{field}.reasoning_content must be a string")
        if "tool_calls" in message:
            message["tool_calls"] = _tool_calls(message["tool_calls"], where, f"{field}.tool_calls")
        normalised.append(message)
    if not prompt_only and not any(m["role"] == "assistant" for m in normalised):
        raise DataError(where, "conversation has no assistant turn, so nothing would be trained")
    return tuple(normalised)


def _text(content: Any, where: str, field: str) -> str:
    """String content as it is; a list of text parts joined (the OpenAI chat format's content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DataError(where, f"{field}[{j}] is a {kind!r} part; only text parts can be trained on")
        return "".join(texts)
    raise DataError(where, f"{field} must be a string or a list of text parts, got {type(content).__name__}")


def _tool_calls(calls: Any, where: str, field: str) -> list[dict[str, Any]]:
    """Tool calls in the OpenAI shape, `arguments` as an object (the templates render objects; Qwen3.5/3.6 can
    render nothing else)."""
    if not isinstance(calls, list):
        raise DataError(where, f"{field} must be a list")
    normalised = []
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(where, f"{field}[{j}] must be an object with a function name")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise DataError(where, f"{field}[{j}].arguments is not JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise DataError(where, f"{field}[{j}].arguments must be a JSON object")
        call = {key: value for key, value in call.items() if value is not None} if "function" in call else {}
        normalised.append({**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return normalised


def _tools(tools: Any, where: str) -> tuple[dict[str, Any], ...] | None:
    if tools is None:
        return None
    if isinstance(tools, str):  # some datasets store the tool list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(where, f"'tools' is not JSON: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise DataError(where, "'tools' must be a list of tool objects")
    return tuple(tools) or None


def _parse_completion(obj: dict[str, Any], where: str) -> CompletionRecord:
    for key in ("prompt", "completion"):
        if key not in obj:
            raise DataError(where, f"record is missing '{key}'")
        if not isinstance(obj[key], str):
            raise DataError(where, f"'{key}' must be a string, got {type(obj[key]).__name__}")
    if not obj["completion"]:
        raise DataError(where, "'completion' is empty, so nothing would be trained")
    return CompletionRecord(prompt=obj["prompt"], completion=obj["completion"])
