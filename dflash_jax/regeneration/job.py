"""A regeneration job: prompt JSONL files -> the target's responses -> training JSONL (see records.py for the
formats, output.py for how a stopped job resumes, decode.py for the decoding).

Records are taken in windows of WINDOW_BATCHES x batch_size, in file order. A window is decoded in rounds:
round k generates the k-th response of every record that needs one (chats may need several), all of a round
in one call of the decoder, which buckets them by prompt length and keeps its batch full (decode.py). When
the whole window is done its records are appended to the output. SIGTERM/SIGINT stop the job after the
window in flight is written. With several processes, each takes every processes-th record (its share) and
appends its window to its own part file, a dropped record there as a `null` line (shares.py merges them); they
agree at every window boundary whether to stop, so a signal to any one of them stops all after the same
window.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from dflash_jax.runtime import distributed
from dflash_jax.runtime.paths import open_input
from dflash_jax.regeneration.decode import BatchDecoder
from dflash_jax.regeneration.output import ResumableJsonl
from dflash_jax.regeneration.records import Regeneration, parse_prompt_record
from dflash_jax.runtime.stop import StopRequest

log = logging.getLogger(__name__)

WINDOW_BATCHES = 8  # batches of records per window: the batch refills from a window's longer queue


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
               output: ResumableJsonl, *, max_prompt_tokens: int, chat_template_kwargs: dict | None = None,
               progress: bool = True, process: int = 0, processes: int = 1) -> Summary:
    """Regenerate every record of this process's share of prompt_files not yet in `output`; returns what this
    run did. With processes > 1 `output` is the process's part file (one line per record of its share)."""
    summary = Summary(records_done=output.records_done)
    share = itertools.islice(read_prompt_records(prompt_files), process, None, processes)
    records = enumerate(share)  # (index within the share, (where, record))
    for _ in range(output.records_done):  # done by an earlier run
        next(records, None)
    total = len(range(process, count_records(prompt_files), processes))
    bar = tqdm(total=total, initial=output.records_done, desc="regenerate", unit="record", dynamic_ncols=True,
               disable=not progress)
    window_size = WINDOW_BATCHES * decoder.batch_size
    with StopRequest() as stop:
        while True:
            window = [(process + index * processes, Regeneration(record, tokenizer, where, chat_template_kwargs))
                      for index, (where, record) in itertools.islice(records, window_size)]
            # Every process stops at the same window boundary: a stop asked of any of them stops all (a process
            # whose share is done takes part with empty windows until every share is).
            if any(distributed.process_flags(stop.requested is not None)):
                summary.stopped_by = stop.requested or "a stop on another process"
                break
            if not any(distributed.process_flags(bool(window))):
                break
            if not window:
                continue
            kept = _run_window(decoder, window, max_prompt_tokens, summary)
            if processes == 1:
                lines = [r.output() for r in kept if r is not None]
            else:
                lines = [None if r is None else r.output() for r in kept]
            output.append(lines, len(window))
            summary.records_done = output.records_done
            summary.written += sum(r is not None for r in kept)
            bar.update(len(window))
            bar.set_postfix(tokens_per_s=f"{summary.tokens_per_second:,.0f}")
    bar.close()
    return summary


def _run_window(decoder: BatchDecoder, window: list[tuple[int, Regeneration]], max_prompt_tokens: int,
                summary: Summary) -> list[Regeneration | None]:
    """Decode every response of the window's records; returns per record, in input order, the regeneration
    to write or None (a prompt too long, or an empty completion)."""
    active = dict(window)
    while True:
        round_rows = []
        for index, regeneration in list(active.items()):
            if regeneration.done:
                continue
            prompt = regeneration.prompt()
            if len(prompt) > max_prompt_tokens:
                log.warning("%s: the prompt has %d tokens, more than the %d that leave room for max_new_tokens; "
                            "skipped", regeneration.where, len(prompt), max_prompt_tokens)
                summary.skipped_long_prompt += 1
                del active[index]
                continue
            round_rows.append((index, regeneration, prompt))
        if not round_rows:
            break
        began = time.perf_counter()
        responses = decoder.decode([prompt for _, _, prompt in round_rows],
                                   [(index, regeneration.turn) for index, regeneration, _ in round_rows])
        summary.decode_seconds += time.perf_counter() - began
        for (_, regeneration, _), tokens in zip(round_rows, responses):
            summary.generated_tokens += len(tokens)
            summary.truncated += len(tokens) == decoder.max_new_tokens and tokens[-1] not in decoder.stop_token_ids
            regeneration.accept(tokens, decoder.stop_token_ids)
    kept = []
    for index, _ in window:
        regeneration = active.get(index)
        if regeneration is not None and regeneration.empty_completion:
            summary.dropped_empty += 1
            regeneration = None
        kept.append(regeneration)
    return kept
