"""The training data iterator: shuffled, streamed, packed, phase-shifted rows of the global batch, for all of
its rows or only some (one host's), with an exact resume point.

Row r of every batch comes from its own `RowStream` (data/stream.py): the records that start in range r of
`batch_size` equal ranges of every source (data/corpus.py), shuffled per epoch, packed greedily
(data/packing.py). Row r of
batch k gets the phase of global row k * batch_size + r, a pure function of the seed. So the rows do not
depend on which host builds them: a loader given `rows` indexes, reads, tokenizes and packs only those
rows' shares of the corpus and yields only those rows, and the same rows come out of it as out of a loader
of the whole batch.

Resume: `state()` holds the batch count and, per row, the cursor of the next row's first piece;
`merge_states` joins the states of the loaders of several hosts into the position of the whole batch, and a
loader built with that (for any of its rows) continues exactly there, whatever the number of hosts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from dflash_jax.data.corpus import Corpus, share_range
from dflash_jax.data.packing import ROW_KEYS, place_row, row_capacity, row_phase, split_context
from dflash_jax.data.stream import RowStream
from dflash_jax.data.sources import resolve_sources
from dflash_jax.data.tokenize import check_chat_tokenizer
from dflash_jax.runtime.errors import DataError

log = logging.getLogger(__name__)

STATE_VERSION = 3
# Version 2 (before sources): one share of the concatenated files per row, the same as version 3 for one file
# of weight 1, the only layout a version-2 state is still accepted for.
_SAME_AS_ONE_FILE = 2
_LAYOUT_KEYS = ("version", "batch_size", "corpus_bytes", "sources", "seed", "seq_len", "anchor_stride")


class BatchLoader(Iterator[dict[str, np.ndarray]]):
    """Yields {"input_ids", "positions", "segment_ids", "loss_mask"}: int32 numpy arrays [len(rows), seq_len],
    rows `rows` of each global batch of `batch_size` rows, in that order. Never ends.

    paths: the entries of config.data.train_files (data/sources.py: files, globs, directories, dataset ids,
        each with an optional @weight); each row's share is indexed in one pass (with `validate`, every
        record is checked then).
    rows: the global batch rows to build (default: all).
    seq_len, anchor_stride: T and S; rows hold T - (S - 1) content tokens, shifted right by a phase in [0, S).
    bad_records: "raise" (default) aborts with a DataError `path:line: reason`; "skip" logs the same message
        as a warning, counts it in stats()["skipped_records"] and moves on. Nothing is dropped silently.
    chat_template_kwargs: extra arguments for `apply_chat_template` (e.g. {"enable_thinking": False}).
    max_positions: the target's max_position_embeddings: a longer document is cut to its first
        max_positions tokens (positions past it would be ones the target never saw), with a warning; the
        counts are in stats()["truncated_documents"] and ["truncated_tokens"] (the tokens cut). None: no limit.
    A document longer than a row is split into overlapping pieces (data/packing.py), counted in
    stats()["split_documents"]; none of its tokens is dropped.
    state: a dict from `state()` or `merge_states` holding (at least) `rows`, to continue exactly there.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        tokenizer: PreTrainedTokenizerBase,
        *,
        seq_len: int,
        anchor_stride: int,
        batch_size: int,
        rows: Sequence[int] | None = None,
        seed: int = 0,
        pad_id: int = 0,
        bad_records: str = "raise",
        validate: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_positions: int | None = None,
        state: dict[str, Any] | None = None,
    ):
        capacity = row_capacity(seq_len, anchor_stride)  # validates 1 <= anchor_stride <= seq_len
        if seq_len % anchor_stride:
            raise ValueError(f"seq_len {seq_len} must be a multiple of anchor_stride {anchor_stride}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rows = list(range(batch_size)) if rows is None else sorted(rows)
        if not self.rows or len(set(self.rows)) != len(self.rows) or not 0 <= self.rows[0] <= self.rows[-1] < batch_size:
            raise ValueError(f"rows must be distinct rows of a batch of {batch_size}, got {rows}")
        self.seq_len, self.anchor_stride, self.batch_size = seq_len, anchor_stride, batch_size
        self.seed, self.pad_id = seed, pad_id
        sources = resolve_sources(paths, "config.data.train_files")
        self.corpus_bytes = sum(s.source.units for s in sources)  # bytes of JSONL + rows of tables
        self._sources = [[s.source.units, s.weight] for s in sources]  # what the shares and epochs follow from
        self._split_documents = self._truncated_documents = self._truncated_tokens = 0
        self.max_positions = max_positions
        self._batches = 0

        jsonl_bytes = sum(hi - lo for s in sources if s.source.unit == "bytes"
                          for lo, hi in (share_range(s.source.units, row, batch_size) for row in self.rows))
        with tqdm(total=jsonl_bytes, unit="B", unit_scale=True, desc="indexing corpus") as bar:
            corpora = [Corpus(sources, row, batch_size, validate=validate, bad_records=bad_records, progress=bar)
                       for row in self.rows]
        self.streams = [RowStream(corpus, row, seed=seed, capacity=capacity, tokenizer=tokenizer,
                                  chat_template_kwargs=chat_template_kwargs, on_split=self._report_split,
                                  max_positions=max_positions, on_truncate=self._report_truncated)
                        for corpus, row in zip(corpora, self.rows)]
        chat_records = [corpus.first_chat_record for corpus in corpora if corpus.first_chat_record is not None]
        if chat_records:
            check_chat_tokenizer(tokenizer, chat_records[0])
        names = ", ".join(s.source.name for s in sources)
        for row, corpus in zip(self.rows, corpora):
            if not corpus.epoch_length:
                ranges = " or ".join(f"{s.source.unit} [{lo}, {hi})" for s, (lo, hi) in zip(sources, corpus.ranges))
                raise DataError(names, f"no record starts in {ranges}, the share of batch row {row}: every row of "
                                f"a batch reads its own 1/{batch_size} of every source, so {_sizes(sources)} are "
                                f"too few for batch_size {batch_size}")
        log.info("rows %s of each batch of %d: %d records of %s (%s)", _spans(self.rows), batch_size,
                 self.num_records, names, _sizes(sources))
        if state is not None:
            self.restore(state)

    @property
    def num_records(self) -> int:
        """Records in the shares of this loader's rows."""
        return sum(len(stream.corpus) for stream in self.streams)

    def corpus_tokens(self) -> int:
        """Tokens one epoch draws from this loader's rows' shares (the whole corpus for a loader of every row),
        each source counted `weight` times: tokenizes each record once. Call it before iterating (it reads the
        same files)."""
        return round(sum(stream.token_count() for stream in self.streams))

    # -- resume ---------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position of the next batch, for this loader's rows."""
        return {"version": STATE_VERSION, "batch_size": self.batch_size, "corpus_bytes": self.corpus_bytes,
                "sources": self._sources, "seed": self.seed, "seq_len": self.seq_len, "anchor_stride": self.anchor_stride,
                "batches": self._batches, "rows": {str(s.row): s.position() for s in self.streams}}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue at `state` (from `state()` or `merge_states`); before the first batch. DataError when it was
        saved for other data or another row layout."""
        now = self.state()
        if state.get("version") == _SAME_AS_ONE_FILE and len(self._sources) == 1 and self._sources[0][1] == 1:
            state = {**state, "version": STATE_VERSION, "sources": self._sources}
        for key in _LAYOUT_KEYS:  # a cursor only means something for the same corpus, order and row layout
            if state.get(key) != now[key]:
                raise DataError("loader state", f"{key} is {state.get(key)!r} in the saved state but {now[key]!r} "
                                                "now; the saved position does not apply to this data/config")
        for stream in self.streams:
            if str(stream.row) not in state["rows"]:
                raise DataError("loader state", f"the saved position has no row {stream.row}")
            stream.restore(state["rows"][str(stream.row)])
        self._batches = int(state["batches"])

    # -- iteration ------------------------------------------------------------------------------------------

    def __next__(self) -> dict[str, np.ndarray]:
        first_row = self._batches * self.batch_size
        placed = [place_row(stream.next_row(), self.seq_len,
                            row_phase(self.seed, first_row + stream.row, self.anchor_stride), self.pad_id)
                  for stream in self.streams]
        self._batches += 1
        return {key: np.stack([p[key] for p in placed]) for key in ROW_KEYS}

    def stats(self) -> dict[str, int]:
        """Counters for logging; `batches` survives resume, the others count since construction."""
        return {
            "batches": self._batches,
            "documents_read": sum(stream.documents_read for stream in self.streams),
            "split_documents": self._split_documents,
            "truncated_documents": self._truncated_documents,
            "truncated_tokens": self._truncated_tokens,
            "skipped_records": sum(stream.corpus.skipped_records for stream in self.streams),
        }

    def close(self) -> None:
        for stream in self.streams:
            stream.corpus.close()

    def _report_truncated(self, where: str, length: int) -> None:
        # Warn once, like a split; the counts are in stats().
        self._truncated_documents += 1
        self._truncated_tokens += length - self.max_positions
        level = logging.WARNING if self._truncated_documents == 1 else logging.DEBUG
        log.log(level, "%s: document of %d tokens is longer than the target's max_position_embeddings (%d); "
                "trained on its first %d tokens only (counted as truncated_documents)", where, length,
                self.max_positions, self.max_positions)

    def _report_split(self, where: str, length: int) -> None:
        capacity = row_capacity(self.seq_len, self.anchor_stride)
        rows = 1 + -(-(length - capacity) // (capacity - split_context(capacity)))
        message = ("%s: document of %d tokens exceeds the row capacity of %d; split into %d rows, each after the "
                   "first starting with %d tokens of the one before as context (positions continue)")
        # Warn once so the user knows it happens; the count is in stats(), per-document detail at debug level.
        level = logging.WARNING if self._split_documents == 0 else logging.DEBUG
        log.log(level, message, where, length, capacity, rows, split_context(capacity))
        self._split_documents += 1


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The position of the whole batch from the states of loaders that build disjoint rows of it (one per
    host), taken after the same batch."""
    merged = {key: value for key, value in states[0].items() if key != "rows"}
    rows: dict[str, Any] = {}
    for state in states:
        different = [key for key in merged if state.get(key) != merged[key]]
        if different:
            raise ValueError(f"loader states disagree on {different}: {state} vs {states[0]}")
        rows.update(state["rows"])
    return {**merged, "rows": dict(sorted(rows.items(), key=lambda item: int(item[0])))}


def _sizes(sources) -> str:
    """"1200 bytes, 40 rows": the sizes of the sources, by unit."""
    return ", ".join(f"{sum(s.source.units for s in sources if s.source.unit == unit)} {unit}"
                     for unit in ("bytes", "rows") if any(s.source.unit == unit for s in sources))


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with adjacent ones joined."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def _spans(rows: Sequence[int]) -> str:
    """Rows as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    runs = _merged([(row, row + 1) for row in rows])
    return ", ".join(str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}" for lo, hi in runs)
