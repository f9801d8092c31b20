"""Turn records into token ids and a loss mask with the target's Hugging Face tokenizer.

Chat records (design §4): the whole conversation is rendered once with the chat template and tokenized once;
nothing else is rendered from it. Each assistant turn is found in that one rendering by the template's own
turn markers (`turn_markers`): the assistant header (the part of the generation prompt that every assistant
turn starts with, e.g. `<|im_start|>assistant\\n`) and the end-of-turn text (e.g. `<|im_end|>`). The Qwen3 and
Qwen3.5/3.6 templates render a `<think>` block only for the assistant turns after the last user query, so the
rendering of a prefix of a conversation is in general not a prefix of the rendering of all of it; locating the
turns in the full rendering needs no such agreement. A turn's span runs from the end of its header through its
end-of-turn text: the reasoning block as rendered, the content, the tool calls and the end-of-turn token are
trained; the header and every system, user and tool token are not. Character spans become token masks through
the fast tokenizer's offset mapping: a token is trained iff it starts inside an assistant span.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_jax.data.records import ChatRecord, CompletionRecord, Record
from dflash_jax.runtime.errors import DataError

# A probe conversation whose answers are unique strings: where they land in its rendering shows the markers.
_PROBE_ANSWERS = ("Probe answer one.", "Probe answer two.")
_PROBE = ({"role": "user", "content": "Probe question one?"}, {"role": "assistant", "content": _PROBE_ANSWERS[0]},
          {"role": "user", "content": "Probe question two?"}, {"role": "assistant", "content": _PROBE_ANSWERS[1]})


@dataclass(frozen=True)
class Document:
    """One tokenized record: int32 ids and an int32 0/1 loss mask of the same length."""

    input_ids: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TurnMarkers:
    """What opens an assistant turn in a template's rendering, and what closes it."""

    header: str
    end: str


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


def tokenize_prompt(record: Record, tokenizer: PreTrainedTokenizerBase, where: str,
                    chat_template_kwargs: dict[str, Any] | None = None) -> np.ndarray:
    """The token ids a generated response follows: a raw prompt's own tokens; a chat (whose last turn is not
    the assistant's) rendered whole with the template's generation prompt, as a server would prompt the
    target."""
    if isinstance(record, CompletionRecord):
        return np.asarray(tokenizer(record.prompt, add_special_tokens=False)["input_ids"], np.int32)
    check_chat_tokenizer(tokenizer, where)
    text = render_chat(tokenizer, list(record.messages), where, chat_template_kwargs or {},
                       tools=list(record.tools) if record.tools else None, add_generation_prompt=True)
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)


def _tokenize_completion(record: CompletionRecord, tokenizer: PreTrainedTokenizerBase) -> Document:
    # Tokenized separately so the prompt/completion boundary is a token boundary.
    prompt_ids = tokenizer(record.prompt, add_special_tokens=False)["input_ids"] if record.prompt else []
    completion_ids = tokenizer(record.completion, add_special_tokens=False)["input_ids"]
    input_ids = np.asarray(prompt_ids + completion_ids, dtype=np.int32)
    loss_mask = np.concatenate([np.zeros(len(prompt_ids), np.int32), np.ones(len(completion_ids), np.int32)])
    return Document(input_ids=input_ids, loss_mask=loss_mask)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], where: str,
                template_kwargs: dict[str, Any], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages`; a template error is a DataError naming the record."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_kwargs)
    except jinja2.TemplateError as e:
        raise DataError(where, f"chat template failed: {e}") from None


_MARKERS: dict[tuple[str, str], TurnMarkers] = {}


def turn_markers(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any], where: str) -> TurnMarkers:
    """The template's assistant header and end-of-turn text, read off its rendering of a probe conversation
    (once per template and kwargs). The header is what the generation prompt and an assistant turn before the
    last query both start with (so a `<think>` block the generation prompt opens is not part of it); the end is
    what follows both probe answers, without trailing whitespace. DataError when either comes out empty."""
    key = (tokenizer.chat_template, json.dumps(template_kwargs, sort_keys=True, default=str))
    if key not in _MARKERS:
        probe = [dict(m) for m in _PROBE]
        question = render_chat(tokenizer, probe[:1], where, template_kwargs)
        prompt = render_chat(tokenizer, probe[:1], where, template_kwargs, add_generation_prompt=True)
        whole = render_chat(tokenizer, probe, where, template_kwargs)
        first, last = whole.find(_PROBE_ANSWERS[0]), whole.rfind(_PROBE_ANSWERS[1])
        header = end = ""
        if prompt.startswith(question) and whole.startswith(question) and 0 <= first < last:
            header = os.path.commonprefix([prompt[len(question):], whole[len(question):first]])
            end = os.path.commonprefix([whole[first + len(_PROBE_ANSWERS[0]):],
                                        whole[last + len(_PROBE_ANSWERS[1]):]]).rstrip()
        if not header.strip() or not end:
            raise DataError(where, "the chat template's assistant turns cannot be located: no assistant header "
                                   f"(found {header!r}) or end-of-turn text (found {end!r}) common to its "
                                   "generation prompt and its rendering of a two-turn conversation")
        _MARKERS[key] = TurnMarkers(header=header, end=end)
    return _MARKERS[key]


def assistant_spans(text: str, markers: TurnMarkers, turns: int, where: str) -> list[tuple[int, int]]:
    """[start, end) character spans of the `turns` assistant turns in a rendered conversation: after each
    assistant header, through the next end-of-turn text."""
    spans, at = [], text.find(markers.header)
    while at >= 0:
        start = at + len(markers.header)
        stop = text.find(markers.end, start)
        if stop < 0:
            raise DataError(where, f"an assistant turn of the rendered conversation has no end-of-turn "
                                   f"{markers.end!r} after it")
        spans.append((start, stop + len(markers.end)))
        at = text.find(markers.header, stop + len(markers.end))
    if len(spans) != turns:
        raise DataError(where, f"the rendered conversation holds {len(spans)} assistant headers "
                               f"{markers.header!r} but the record has {turns} assistant turns, so its turns "
                               "cannot be located (a message containing the header text, or a template that "
                               "drops or merges assistant turns)")
    return spans


def _tokenize_chat(
    record: ChatRecord, tokenizer: PreTrainedTokenizerBase, where: str, template_kwargs: dict[str, Any]
) -> Document:
    check_chat_tokenizer(tokenizer, where)
    messages = [dict(m) for m in record.messages]  # the template may not mutate the record
    tools = [dict(t) for t in record.tools] if record.tools else None
    text = render_chat(tokenizer, messages, where, template_kwargs, tools)
    turns = sum(m["role"] == "assistant" for m in messages)
    spans = assistant_spans(text, turn_markers(tokenizer, template_kwargs, where), turns, where)

    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    token_starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
    loss_mask = np.zeros(len(token_starts), np.int32)
    for turn, (span_start, span_end) in enumerate(spans):
        in_span = (token_starts >= span_start) & (token_starts < span_end)
        if not in_span.any():
            raise DataError(where, f"assistant turn {turn} produced no tokens")
        loss_mask[in_span] = 1
    return Document(input_ids=np.asarray(encoding["input_ids"], dtype=np.int32), loss_mask=loss_mask)
