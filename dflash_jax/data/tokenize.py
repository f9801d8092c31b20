"""Turn records into token ids and a loss mask with the target's Hugging Face tokenizer.

Chat records: the whole conversation is rendered once with the chat template and tokenized once. Each
assistant turn's character span is found by rendering prefixes of the conversation: the turn starts where
`messages[:i]` + generation prompt ends and ends where `messages[:i+1]` ends (minus trailing whitespace the
template writes after the end-of-turn token, e.g. ChatML's newline after `<|im_end|>`). Both renders must be
prefixes of the full render (true for ChatML/Qwen templates on ordinary chats); a template that rewrites
earlier turns depending on what follows violates this and is reported, never guessed around. Character
spans become token masks through the fast tokenizer's offset mapping: a token is trained iff it starts
inside an assistant span, so the role header `<|im_start|>assistant\\n` is not trained, the assistant content
and its closing `<|im_end|>` are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_jax.data.records import ChatRecord, CompletionRecord, Record
from dflash_jax.errors import DataError


@dataclass(frozen=True)
class Document:
    """One tokenized record: int32 ids and an int32 0/1 loss mask of the same length."""

    input_ids: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


def check_chat_tokenizer(tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    """Raise DataError unless `tokenizer` can tokenize chat records (chat template + offset mapping)."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(where, f"'messages' record needs a tokenizer with a chat template; {name!r} has none")
    if not tokenizer.is_fast:
        raise DataError(where, f"'messages' records need a fast tokenizer (offset mapping); {name!r} is slow")


def tokenize_record(
    record: Record,
    tokenizer: PreTrainedTokenizerBase,
    where: str,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Document:
    """Tokenize one record. `chat_template_kwargs` go to `apply_chat_template` (e.g. enable_thinking)."""
    if isinstance(record, ChatRecord):
        return _tokenize_chat(record, tokenizer, where, chat_template_kwargs or {})
    if isinstance(record, CompletionRecord):
        return _tokenize_completion(record, tokenizer)
    raise TypeError(f"unknown record type {type(record).__name__}")


def _tokenize_completion(record: CompletionRecord, tokenizer: PreTrainedTokenizerBase) -> Document:
    # Tokenized separately so the prompt/completion boundary is a token boundary.
    prompt_ids = tokenizer(record.prompt, add_special_tokens=False)["input_ids"] if record.prompt else []
    completion_ids = tokenizer(record.completion, add_special_tokens=False)["input_ids"]
    input_ids = np.asarray(prompt_ids + completion_ids, dtype=np.int32)
    loss_mask = np.concatenate([np.zeros(len(prompt_ids), np.int32), np.ones(len(completion_ids), np.int32)])
    return Document(input_ids=input_ids, loss_mask=loss_mask)


def _tokenize_chat(
    record: ChatRecord, tokenizer: PreTrainedTokenizerBase, where: str, template_kwargs: dict[str, Any]
) -> Document:
    check_chat_tokenizer(tokenizer, where)
    messages = list(record.messages)

    def render(prefix: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                prefix, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except jinja2.TemplateError as e:
            raise DataError(where, f"chat template failed on messages[:{len(prefix)}]: {e}") from None

    full_text = render(messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], add_generation_prompt=True)
        through = render(messages[: i + 1], add_generation_prompt=False)
        if not (full_text.startswith(before) and full_text.startswith(through) and through.startswith(before)):
            raise DataError(
                where,
                f"chat template violates the prefix property at assistant turn messages[{i}]: rendering the "
                "conversation up to this turn is not a prefix of rendering all of it, so the turn's tokens "
                "cannot be located (the template rewrites earlier turns depending on later ones)",
            )
        spans.append((i, len(before), len(through.rstrip())))

    encoding = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    token_starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
    loss_mask = np.zeros(len(token_starts), np.int32)
    for i, span_start, span_end in spans:
        in_span = (token_starts >= span_start) & (token_starts < span_end)
        if not in_span.any():
            raise DataError(where, f"assistant turn messages[{i}] produced no tokens")
        loss_mask[in_span] = 1
    return Document(input_ids=np.asarray(encoding["input_ids"], dtype=np.int32), loss_mask=loss_mask)
