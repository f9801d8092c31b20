"""The drafter's data for the toy target: code prefixes from held-out files as prompts, the target's own
greedy continuations as completions (target-regenerated data, written by the project's `regenerate` code,
as `python -m dflash_jax.regenerate --config configs/toy.py --batch_size 16` would), and how varied those
continuations are."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from dflash_jax.models.qwen3 import Qwen3
from dflash_jax.regeneration.decode import BatchDecoder
from dflash_jax.regeneration.job import regenerate
from dflash_jax.regeneration.output import PROGRESS_SUFFIX, ResumableJsonl
from tools.toy_target.corpus import encode

PROMPT_MIN, PROMPT_MAX = 64, 192  # prompt tokens; prompt + completion must fit the LM's trained length
BATCH_SIZE = 16  # prompts decoded together (tests/weights/test_toy_target.py regenerates the first batch the same way)


def cut_points(text: str) -> list[int]:
    """Offsets of line ends (the '\\n' itself) after a non-blank character.

    Cutting just before such a newline is a pre-tokenizer boundary (the newline starts a new whitespace
    piece), so the prompt tokenizes exactly as it does inside the whole file, and the completion starts
    with the newline. Cutting after the newline would split the '\\n    ' indentation piece.
    """
    return [i for i, char in enumerate(text) if char == "\n" and i > 0 and not text[i - 1].isspace()]


def line_starts(text: str) -> list[int]:
    """Offsets where a non-blank line begins."""
    starts, offset = [], 0
    for line in text.split("\n"):
        if line.strip():
            starts.append(offset)
        offset += len(line) + 1
    return starts


def sample_prompts(files: list[tuple[str, str]], tokenizer, count: int, rng: np.random.Generator,
                   min_tokens: int = PROMPT_MIN, max_tokens: int = PROMPT_MAX) -> tuple[list[dict], int]:
    """`count` distinct prompts: text from a random line start to a line end, min..max tokens long.

    Files are drawn in proportion to their length. Returns the prompts and how many draws were rejected.
    """
    weights = np.asarray([len(text) for _, text in files], np.float64)
    cuts = [cut_points(text) for _, text in files]
    starts = [line_starts(text) for _, text in files]
    prompts, seen, rejected = [], set(), 0
    while len(prompts) < count:
        index = int(rng.choice(len(files), p=weights / weights.sum()))
        source, text = files[index]
        ends = cuts[index]
        start = starts[index][int(rng.integers(0, len(starts[index])))]
        wanted = int(rng.integers(min_tokens, max_tokens + 1))
        prompt = None
        for end in ends[np.searchsorted(ends, start):]:  # grow line by line up to `wanted` tokens
            tokens = len(encode(tokenizer, text[start:end]))
            if tokens > max_tokens:
                break
            if tokens >= min_tokens:
                prompt = text[start:end]
            if tokens >= wanted:
                break
        if prompt is None or (source, start) in seen:
            rejected += 1
            continue
        seen.add((source, start))
        prompts.append({"source": source, "prompt": prompt, "ids": encode(tokenizer, prompt),
                        "reference": text[start + len(prompt):][:4000]})
    return prompts, rejected


def greedy_continuations(model: Qwen3, prompts: list[list[int]], new_tokens: int, eos_id: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (at most new_tokens, ending at eos if it comes)."""
    decoder = BatchDecoder(model, batch_size=BATCH_SIZE, max_new_tokens=new_tokens, stop_token_ids=(eos_id,))
    return decoder.decode(prompts, [()] * len(prompts))


def write_regenerated(model: Qwen3, tokenizer, prompts: list[dict], new_tokens: int, eos_id: int, path: Path) -> dict:
    """Write `{"prompt", "completion", "source"}` records to path: the prompts' greedy continuations, cut at
    eos (empty ones dropped), through the regeneration job. Returns its counts."""
    decoder = BatchDecoder(model, batch_size=BATCH_SIZE, max_new_tokens=new_tokens, stop_token_ids=(eos_id,))
    path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        prompt_file = Path(scratch) / "prompts.jsonl"
        prompt_file.write_text("".join(json.dumps({"prompt": p["prompt"], "source": p["source"]}) + "\n"
                                       for p in prompts))
        summary = regenerate(decoder, tokenizer, [str(prompt_file)], ResumableJsonl(path, {}),
                             max_prompt_tokens=model.config.max_position_embeddings - new_tokens, progress=False)
    path.with_name(path.name + PROGRESS_SUFFIX).unlink()  # the data is complete: nothing to resume
    return {"prompts": len(prompts), "kept": summary.written, "dropped_empty": summary.dropped_empty,
            "cut_at_max_tokens": summary.truncated, "prompt_roundtrip": sum(
                encode(tokenizer, p["prompt"]) == p["ids"] for p in prompts)}


def diversity(token_lists: list[list[int]]) -> dict:
    """How varied continuations are: distinct tokens / tokens overall, and per continuation the distinct
    token and 4-gram fractions."""
    all_tokens = [t for ids in token_lists for t in ids]
    per_token, per_4gram = [], []
    for ids in token_lists:
        grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
        per_token.append(len(set(ids)) / max(1, len(ids)))
        if grams:
            per_4gram.append(len(set(grams)) / len(grams))
    return {"distinct_token_ratio": len(set(all_tokens)) / max(1, len(all_tokens)),
            "mean_distinct_token_fraction": float(np.mean(per_token)),
            "mean_distinct_4gram_fraction": float(np.mean(per_4gram)),
            "tokens": len(all_tokens)}


def repeated_line_fraction(texts: list[str]) -> float:
    """Of all non-blank lines, the share that repeat an earlier line of the same continuation."""
    repeats = total = 0
    for text in texts:
        lines = [line.strip() for line in text.split("\n") if line.strip()]
        repeats += len(lines) - len(set(lines))
        total += len(lines)
    return repeats / max(1, total)
