"""A small real byte-level BPE tokenizer with a Qwen-style ChatML template, built offline for tests.

Usage: `from tests.tokenizer_fixture import make_chat_tokenizer`. Each call returns a fresh
`PreTrainedTokenizerFast` (tests may mutate it); the BPE training itself runs once per process.
`make_qwen_tokenizer("qwen3")` / `("qwen3_5")` gives the same BPE with the Qwen chat tokens and the published
Qwen3 or Qwen3.5/3.6 chat template (tests/fixtures/chat_templates/).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a model token draft block anchor target layer train loss mask row packed document "
    "segment position phase stride batch epoch seed shuffle stream file line json user system "
    "assistant question answer hello world please explain why how what code python def return "
    "for in if else while import numpy jax value list dict print error result first second third"
).split()


def _training_lines(count: int = 400, seed: int = 0) -> list[str]:
    """Deterministic English-ish and code-ish lines so the BPE learns ordinary merges."""
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if i % 4 == 0:
            lines.append(f"def f_{i}(x):\n    return x + {i}  # {' '.join(words)}")
        else:
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
    return lines


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_lines(), trainer=trainer)
    return tokenizer.to_str()


def make_chat_tokenizer(with_chat_template: bool = True, vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A fresh fast tokenizer; `with_chat_template=False` gives one without a chat template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if with_chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


CHAT_TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
# The Qwen tokenizers' added tokens the chat templates write: <think>/</think> and the tool tags are added but
# not special in Qwen's tokenizer_config.json, so they are added the same way here.
QWEN_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def make_qwen_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """The test BPE with Qwen's chat tokens and `tests/fixtures/chat_templates/<template>.jinja`."""
    tokenizer = make_chat_tokenizer(with_chat_template=False)
    tokenizer.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in QWEN_TAGS])
    tokenizer.chat_template = (CHAT_TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer
