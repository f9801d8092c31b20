"""The toy target's corpus (the Python standard library's own sources), its name-based splits, and a
byte-level BPE tokenizer trained on it."""

from __future__ import annotations

import hashlib
from pathlib import Path
import sysconfig

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Directories whose files are fixtures, data or generated tables rather than ordinary code.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data",
                 "lib-dynload"}
HELDOUT_PERCENT = 16  # files with hash bucket < 16 (of 100) are held out of LM training
EVAL_PERCENT = 4  # ... and those with bucket < 4 are the drafter's eval files

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
EOS, MASK = "<|endoftext|>", "<|mask|>"
TOKENIZER_SIZE = 4000
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib *.py file that is ordinary code, sorted by path."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        directories = relative.split("/")[:-1]
        if any(d in EXCLUDED_DIRS or d.startswith("config-") for d in directories):
            continue
        if path.name.startswith("_sysconfigdata"):  # machine-specific build settings, not code
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            files.append((relative, text))
    return files


def split_of(relative_path: str) -> str:
    """'lm', 'drafter_train' or 'drafter_eval', decided by the file's name alone (stable across runs)."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
    if bucket < EVAL_PERCENT:
        return "drafter_eval"
    if bucket < HELDOUT_PERCENT:
        return "drafter_train"
    return "lm"


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) with the special tokens at ids 0..3."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS, mask_token=MASK,
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> np.ndarray:
    """All texts tokenized and concatenated, each followed by <|endoftext|> (GPT-style document packing)."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids + [eos], np.int32) for e in encodings])
