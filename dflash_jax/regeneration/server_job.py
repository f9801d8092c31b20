"""A regeneration job through serving engines (design §14): the records of the prompt files sent to one or more
OpenAI-compatible servers (vLLM, SGLang), the output written as the JAX path writes it (job.py).

Each server has `concurrency` worker threads, so at most that many requests are in flight on it; the workers
of all servers take records from one queue, so a faster server takes more. A worker carries one record
through all its turns on its server: a prompt record is one request to /v1/completions, a chat one request to
/v1/chat/completions per assistant turn, each given the conversation so far with the earlier turns already
regenerated. Records finish out of order; the output takes them back in input order and appends every
contiguous run of finished records (ResumableJsonl: a rerun continues after the last record appended).

Exactness: a response is the server's generated token ids (`return_token_ids`, vLLM >= 0.10.2 and SGLang),
decoded here by the target's tokenizer exactly as the JAX path decodes its own (records.py), never the
server's text. A prompt record is sent as the token ids the JAX path decodes from; a chat is rendered by the
server, and the prompt ids it reports are checked against this side's rendering, so a server whose template
or tokenizer differs from the target's is one error, not silently different data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from dflash_jax.runtime.errors import DataError
from dflash_jax.regeneration.job import Summary, count_records, read_prompt_records
from dflash_jax.regeneration.output import ResumableJsonl
from dflash_jax.regeneration.records import Regeneration
from dflash_jax.regeneration.server_client import RequestRefused, Server, ServerUnreachable
from dflash_jax.runtime.stop import StopRequest

log = logging.getLogger(__name__)
# Hugging Face fast tokenizers are not safe to call from several threads at once (the Rust side can fail with
# "Already borrowed"); rendering and decoding take microseconds beside a generation, so workers take turns.
_TOKENIZER_LOCK = threading.Lock()
FLUSH_EVERY_S = 2.0  # finished records are appended at least this often (each append is one fsync)
WINDOW_PER_WORKER = 4  # records read ahead per worker: bounds what a slow record holds back in memory


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The request's sampling fields; None leaves one to the server (the model's generation_config)."""
    model: str
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    temperature: float | None = None
    top_p: float | None = None
    seed: int = 0
    chat_template_kwargs: dict | None = None

    def body(self, index: int, turn: int) -> dict[str, Any]:
        body = {"model": self.model, "max_tokens": self.max_tokens, "stop_token_ids": list(self.stop_token_ids),
                "seed": request_seed(self.seed, index, turn), "return_token_ids": True, "stream": False}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        return body


def request_seed(seed: int, index: int, turn: int) -> int:
    """A record's turn samples with its own seed (31 bits, which every engine takes), so a response depends on
    the record alone, not on which server or request slot it got or whether the job was resumed."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}/{turn}".encode()).digest()[:4], "big") >> 1


@dataclasses.dataclass
class _Done:
    index: int
    regeneration: Regeneration | None  # None: the record was skipped (prompt too long)
    tokens: int = 0
    truncated: int = 0


def regenerate_record(server: Server, regeneration: Regeneration, index: int, sampling: Sampling,
                      max_model_len: int | None) -> _Done:
    """Every response of one record, turn by turn, from `server`. Raises DataError naming the record."""
    done = _Done(index, regeneration)
    while not regeneration.done:
        with _TOKENIZER_LOCK:
            prompt = regeneration.prompt()  # this side's ids: the length check, and the chat check below
        if max_model_len is not None and len(prompt) + sampling.max_tokens > max_model_len:
            log.warning("%s: the prompt has %d tokens, more than the %d that leave room for max_new_tokens "
                        "within the served model's %d; skipped", regeneration.where, len(prompt),
                        max_model_len - sampling.max_tokens, max_model_len)
            return _Done(index, None)
        body = sampling.body(index, regeneration.turn)
        if regeneration.messages is None:
            path = "/v1/completions"
            body["prompt"] = prompt
        else:
            path = "/v1/chat/completions"
            body["messages"] = regeneration.conversation()
            if regeneration.tools:  # rendered into the prompt as training renders it; the answer stays raw text
                body["tools"], body["tool_choice"] = regeneration.tools, "none"
            if sampling.chat_template_kwargs:
                body["chat_template_kwargs"] = sampling.chat_template_kwargs
        try:
            response = server.post(path, body)
        except RequestRefused as error:
            raise DataError(regeneration.where, f"{server}{path} refused the request: {error}") from None
        except ServerUnreachable as error:
            raise DataError(regeneration.where, f"no answer from the server: {error}") from None
        tokens, served_prompt, finish = _choice(response, regeneration.where, server)
        if served_prompt is not None and served_prompt != prompt:
            first = next((i for i, (a, b) in enumerate(zip(served_prompt, prompt)) if a != b),
                         min(len(served_prompt), len(prompt)))
            raise DataError(regeneration.where, f"{server} rendered turn {regeneration.turn} to other token ids "
                                                f"than the target's tokenizer here (first difference at token "
                                                f"{first}); serve the target's own tokenizer and chat template, "
                                                f"or pass that tokenizer as --tokenizer")
        done.tokens += len(tokens)
        done.truncated += finish == "length"
        with _TOKENIZER_LOCK:
            regeneration.accept(tokens, sampling.stop_token_ids)
    return done


def _choice(response: dict, where: str, server: Server) -> tuple[list[int], list[int] | None, str | None]:
    """(generated ids, the prompt ids the server used or None, finish_reason) of a one-choice response."""
    try:
        choice = response["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise DataError(where, f"{server} answered without choices: {str(response)[:300]}") from None
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list):
        raise DataError(where, f"{server} returned no token ids (choices[0].token_ids); regenerate --server needs "
                               f"an engine that honours return_token_ids (vLLM >= 0.10.2, SGLang with it)")
    served_prompt = choice.get("prompt_token_ids", response.get("prompt_token_ids"))
    if served_prompt is not None:
        served_prompt = [int(t) for t in served_prompt]
    return [int(t) for t in tokens], served_prompt, choice.get("finish_reason")


class _InInputOrder:
    """Finished records put back in input order: `flush()` appends the contiguous run from the next record to
    write (nothing after the first unfinished one), counting what it wrote, skipped and dropped."""

    def __init__(self, output: ResumableJsonl, summary: Summary, bar: tqdm):
        self.output, self.summary, self.bar = output, summary, bar
        self.next_index = output.records_done
        self.finished: dict[int, _Done] = {}
        self.last_flush = time.monotonic()

    def add(self, done: _Done) -> None:
        self.finished[done.index] = done

    def flush(self) -> None:
        run = []
        while self.next_index in self.finished:
            run.append(self.finished.pop(self.next_index))
            self.next_index += 1
        self.last_flush = time.monotonic()
        if not run:
            return
        answered = [d.regeneration for d in run if d.regeneration is not None]
        kept = [r for r in answered if not r.empty_completion]
        self.output.append([r.output() for r in kept], len(run))
        self.summary.written += len(kept)
        self.summary.skipped_long_prompt += len(run) - len(answered)
        self.summary.dropped_empty += len(answered) - len(kept)
        self.summary.records_done = self.output.records_done
        self.bar.update(len(run))


def regenerate_through_servers(servers: Sequence[Server], tokenizer: PreTrainedTokenizerBase,
                               prompt_files: Sequence[str], output: ResumableJsonl, sampling: Sampling, *,
                               concurrency: int, max_model_len: int | None = None,
                               progress: bool = True) -> Summary:
    """Regenerate every record of prompt_files not yet in `output` (module docstring); returns what this run
    did. SIGTERM/SIGINT stop it: the finished records before the first unfinished one are appended first."""
    summary = Summary(records_done=output.records_done)
    records = read_prompt_records(prompt_files)
    for _ in range(output.records_done):  # done by an earlier run
        next(records, None)
    work: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()
    cancelled = threading.Event()

    def worker(server: Server) -> None:
        while not cancelled.is_set():
            item = work.get()
            if item is None:
                return
            index, regeneration = item
            try:
                results.put(regenerate_record(server, regeneration, index, sampling, max_model_len))
            except BaseException as error:  # reported by the main thread, which stops the job
                results.put(error)

    threads = [threading.Thread(target=worker, args=(server,), daemon=True, name=f"regenerate {server} {i}")
               for server in servers for i in range(concurrency)]
    for thread in threads:
        thread.start()
    bar = tqdm(total=count_records(prompt_files), initial=output.records_done, desc="regenerate", unit="record",
               dynamic_ncols=True, disable=not progress)
    writer = _InInputOrder(output, summary, bar)
    window = WINDOW_PER_WORKER * len(threads)
    next_read, exhausted, began = output.records_done, False, time.perf_counter()
    try:
        with StopRequest() as stop:
            while not stop.requested:
                while not exhausted and next_read - writer.next_index < window:
                    item = next(records, None)
                    exhausted = item is None
                    if not exhausted:
                        where, record = item
                        work.put((next_read, Regeneration(record, tokenizer, where, sampling.chat_template_kwargs)))
                        next_read += 1
                if exhausted and writer.next_index + len(writer.finished) == next_read:
                    break
                try:
                    result = results.get(timeout=0.5)
                except queue.Empty:
                    result = None
                if isinstance(result, BaseException):
                    raise result
                if result is not None:
                    writer.add(result)
                    summary.generated_tokens += result.tokens
                    summary.truncated += result.truncated
                    summary.decode_seconds = time.perf_counter() - began
                    bar.set_postfix(tokens_per_s=f"{summary.tokens_per_second:,.0f}")
                if len(writer.finished) >= len(threads) or time.monotonic() - writer.last_flush > FLUSH_EVERY_S:
                    writer.flush()
            summary.stopped_by = stop.requested
    finally:  # also on an error: what finished before the first unfinished record stays written
        cancelled.set()
        for _ in threads:
            work.put(None)
        writer.flush()
        bar.close()
    return summary
