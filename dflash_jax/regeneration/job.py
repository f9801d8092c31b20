"""A regeneration job: prompt JSONL files -> the target's responses -> training JSONL (see records.py for the
formats, output.py for how a stopped job resumes, decode.py for the decoding).

Records are taken `batch_size` at a time in file order. A batch is decoded in rounds: round k generates the
k-th response of every record that needs one (chats may need several), all rows of a round in one batched
call, padded to `batch_size` rows so every call has the same shape. When the whole batch is done its
records are appended to the output. SIGTERM/SIGINT stop the job after the batch in flight is written.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from dflash_jax.paths import open_input
from dflash_jax.regeneration.decode import BatchDecoder
from dflash_jax.regeneration.output import ResumableJsonl
from dflash_jax.regeneration.records import Regeneration, parse_prompt_record
from dflash_jax.train.checkpoint import StopRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Summary:
    records_done: int = 0  # input records accounted for, this run and earlier ones
    written: int = 0  # records written by this run
    skipped_long_prompt: int = 0  # the prompt left no room for max_new_tokens within the target's positions
    dropped_empty: int = 0  # prompt records whose completion came out empty (not valid training data)
    truncated: int = 0  # responses cut at max_new_tokens without a stop token
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    stopped_by: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0


def read_prompt_records(files: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path:line, record) of every non-blank line, in file order."""
    for path in files:
        with io.TextIOWrapper(open_input(path), encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    where = f"{path}:{number}"
                    yield where, parse_prompt_record(line, where)


def count_records(files: Sequence[str]) -> int:
    total = 0
    for path in files:
        with io.TextIOWrapper(open_input(path), encoding="utf-8") as handle:
            total += sum(1 for line in handle if line.strip())
    return total


def regenerate(decoder: BatchDecoder, tokenizer: PreTrainedTokenizerBase, prompt_files: Sequence[str],
               output: ResumableJsonl, *, batch_size: int, max_prompt_tokens: int,
               chat_template_kwargs: dict | None = None, progress: bool = True) -> Summary:
    """Regenerate every record of prompt_files not yet in `output`; returns what this run did."""
    summary = Summary(records_done=output.records_done)
    records = read_prompt_records(prompt_files)
    for _ in range(output.records_done):  # done by an earlier run
        next(records, None)
    bar = tqdm(total=count_records(prompt_files), initial=output.records_done, desc="regenerate", unit="record",
               dynamic_ncols=True, disable=not progress)
    index = output.records_done
    with StopRequest() as stop:
        while not stop.requested:
            batch = [(index + i, Regeneration(record, tokenizer, where, chat_template_kwargs))
                     for i, (where, record) in zip(range(batch_size), records)]
            if not batch:
                break
            index += len(batch)
            written = _run_batch(decoder, batch, batch_size, max_prompt_tokens, summary)
            output.append([r.output() for r in written], len(batch))
            summary.records_done, summary.written = output.records_done, summary.written + len(written)
            bar.update(len(batch))
            bar.set_postfix(tokens_per_s=f"{summary.tokens_per_second:,.0f}")
        summary.stopped_by = stop.requested
    bar.close()
    return summary


def _run_batch(decoder: BatchDecoder, batch: list[tuple[int, Regeneration]], batch_size: int,
               max_prompt_tokens: int, summary: Summary) -> list[Regeneration]:
    """Decode every response of the batch's records; returns the records to write, in input order."""
    active = list(batch)
    while True:
        round_rows = []
        for index, regeneration in list(active):
            if regeneration.done:
                continue
            prompt = regeneration.prompt()
            if len(prompt) > max_prompt_tokens:
                log.warning("%s: the prompt has %d tokens, more than the %d that leave room for max_new_tokens; "
                            "skipped", regeneration.where, len(prompt), max_prompt_tokens)
                summary.skipped_long_prompt += 1
                active.remove((index, regeneration))
                continue
            round_rows.append((index, regeneration, prompt))
        if not round_rows:
            break
        prompts = [prompt for _, _, prompt in round_rows]
        keys = [(index, regeneration.turn) for index, regeneration, _ in round_rows]
        padding = batch_size - len(prompts)  # rows repeating the first prompt keep the call's shape fixed
        began = time.perf_counter()
        responses = decoder.decode(prompts + prompts[:1] * padding, keys + keys[:1] * padding)[:len(prompts)]
        summary.decode_seconds += time.perf_counter() - began
        for (_, regeneration, _), tokens in zip(round_rows, responses):
            summary.generated_tokens += len(tokens)
            summary.truncated += len(tokens) == decoder.max_new_tokens and tokens[-1] not in decoder.stop_token_ids
            regeneration.accept(tokens, decoder.stop_token_ids)
    kept = []
    for _, regeneration in active:
        if regeneration.empty_completion:
            summary.dropped_empty += 1
        else:
            kept.append(regeneration)
    return kept
