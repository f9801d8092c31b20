"""Prompt records in, training records out: what `regenerate` asks the target and what it writes.

Input, one JSON object per line, in the training formats (data/records.py), where the responses are optional
and are replaced anyway:
  {"prompt": "...", ["completion": "..."]}     raw text: the completion is the target's continuation
  {"messages": [{"role", "content"}, ...], ["tools": [...]]}
                                                chat: every assistant turn is the target's response, the tools
                                                rendered into its prompt as training renders them
  {"conversations": [{"from", "value"}, ...]}   ShareGPT chat, written back as "messages"
A conversation's assistant turns are generated in order, each from the conversation before it with the
earlier turns already regenerated, so the whole conversation is the target's own; a conversation that does
not end with an assistant turn gets one. Other keys of the record (and of user/system messages) are kept.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from dflash_jax.data.records import CompletionRecord, parse_object
from dflash_jax.data.tokenize import check_chat_tokenizer, render_chat
from dflash_jax.runtime.errors import DataError


def parse_prompt_record(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as a record object, read as training reads it (data/records.py: OpenAI or ShareGPT chats,
    content parts, tool calls and tools; raw prompts): a chat as {"messages", ["tools"]} in the OpenAI form, a
    raw one as {"prompt"}, and the record's other keys kept. Raises DataError(where, reason)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(where, f"invalid JSON: {error}") from None
    record = parse_object(obj, where, prompt_only=True)
    rest = {key: value for key, value in obj.items() if key not in _RECORD_KEYS and value is not None}
    if isinstance(record, CompletionRecord):
        return {"prompt": record.prompt, **rest}
    if all(m["role"] == "assistant" for m in record.messages):
        raise DataError(where, "the conversation has only assistant turns, so there is nothing to respond to")
    return {"messages": list(record.messages), **({"tools": list(record.tools)} if record.tools else {}), **rest}


_RECORD_KEYS = ("prompt", "completion", "messages", "conversations", "tools")


class Regeneration:
    """One record on its way through the target: `prompt()` gives the next token ids to continue, `accept()`
    takes the target's response to them, `done` says when `output()` is ready."""

    def __init__(self, record: dict[str, Any], tokenizer: PreTrainedTokenizerBase, where: str,
                 chat_template_kwargs: dict | None = None):
        self.record, self.tokenizer, self.where = record, tokenizer, where
        self.tools = record.get("tools")  # the chat's tool definitions, rendered into every prompt
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.responses: list[str] = []
        if "messages" in record:
            check_chat_tokenizer(tokenizer, where)
            messages = list(record["messages"])
            if messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            self.messages = messages
            self.turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        else:
            self.messages, self.turns = None, [None]

    @property
    def done(self) -> bool:
        return len(self.responses) == len(self.turns)

    @property
    def turn(self) -> int:
        """Which response comes next (0 for the first)."""
        return len(self.responses)

    @property
    def empty_completion(self) -> bool:
        """A prompt record whose completion came out empty: not valid training data, so it is not written."""
        return self.messages is None and self.done and not self.responses[0]

    def prompt(self) -> list[int]:
        """The token ids to continue: a raw prompt's own; a chat rendered as training renders it (its tools
        included), with the template's generation prompt."""
        text = self.record["prompt"] if self.messages is None else render_chat(
            self.tokenizer, self.conversation(), self.where, self.template_kwargs, tools=self.tools,
            add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def conversation(self) -> list[dict[str, Any]]:
        """A chat's messages before the next assistant turn, the turns answered so far replaced by their
        responses: what the target answers next (rendered by `prompt()`, or sent to a server as it is)."""
        return self._conversation(self.turns[self.turn])

    def accept(self, token_ids: Sequence[int], stop_token_ids: Sequence[int]) -> None:
        """The response: the generated ids without a final stop token, decoded as the tokenizer writes them."""
        ids = list(token_ids)
        if ids and ids[-1] in stop_token_ids:
            ids = ids[:-1]
        self.responses.append(self.tokenizer.decode(ids))

    def output(self) -> dict[str, Any]:
        """The training record: the responses in place of the record's own, its other keys kept."""
        rest = {key: value for key, value in self.record.items() if key not in ("prompt", "completion", "messages")}
        if self.messages is None:
            return {"prompt": self.record["prompt"], "completion": self.responses[0], **rest}
        return {"messages": self._conversation(len(self.messages)), **rest}

    def _conversation(self, end: int) -> list[dict[str, Any]]:
        """messages[:end] with the assistant turns answered so far replaced by their responses."""
        response_of = dict(zip(self.turns, self.responses))
        return [{"role": "assistant", "content": response_of[i]} if i in response_of else m
                for i, m in enumerate(self.messages[:end])]
