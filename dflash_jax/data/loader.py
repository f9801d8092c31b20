"""The training data iterator: shuffled, streamed, packed, phase-shifted batches with an exact resume point.

Each epoch visits every record once in a permutation seeded by (seed, epoch); records are read from disk
one at a time (see `Corpus`). The document stream runs across epochs without a break (a row may hold the
last documents of one epoch and the first of the next); with `num_epochs=None` it never ends. Rows are
packed greedily (see `packing`), each row gets a phase from (seed, global row index), and `batch_size` rows
form a batch. With a finite `num_epochs`, the last batch is completed with all-padding rows (loss_mask 0),
then iteration stops.

Resume: `state()` names the first row not yet returned by the cursor of its first piece and the global row
count; a loader built with that state re-reads from the cursor and reproduces the same rows and phases.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_jax.data.corpus import Corpus
from dflash_jax.data.packing import ROW_KEYS, Cursor, PackedRow, RowPacker, place_row, row_capacity, row_phase
from dflash_jax.data.tokenize import Document, check_chat_tokenizer, tokenize_record
from dflash_jax.errors import DataError

log = logging.getLogger(__name__)

STATE_VERSION = 1


class BatchLoader(Iterator[dict[str, np.ndarray]]):
    """Yields {"input_ids", "positions", "segment_ids", "loss_mask"}: int32 numpy arrays [batch_size, seq_len].

    paths: JSONL files, indexed in one pass (with `validate`, every record's JSON and fields are checked then).
    seq_len, anchor_stride: T and S; rows hold T - (S - 1) content tokens, shifted right by a phase in [0, S).
    bad_records: "raise" (default) aborts with a DataError `path:line: reason`; "skip" logs the same message
        as a warning, counts it in stats()["skipped_records"] and moves on. Nothing is dropped silently.
    chat_template_kwargs: extra arguments for `apply_chat_template` (e.g. {"enable_thinking": False}).
    state: a dict from `state()` to continue exactly where that loader was.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        tokenizer: PreTrainedTokenizerBase,
        *,
        seq_len: int,
        anchor_stride: int,
        batch_size: int,
        seed: int = 0,
        num_epochs: int | None = None,
        pad_id: int = 0,
        bad_records: str = "raise",
        validate: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        state: dict[str, Any] | None = None,
    ):
        capacity = row_capacity(seq_len, anchor_stride)  # validates 1 <= anchor_stride <= seq_len
        if seq_len % anchor_stride:
            raise ValueError(f"seq_len {seq_len} must be a multiple of anchor_stride {anchor_stride}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokenizer = tokenizer
        self.seq_len, self.anchor_stride, self.batch_size = seq_len, anchor_stride, batch_size
        self.seed, self.num_epochs, self.pad_id = seed, num_epochs, pad_id
        self.chat_template_kwargs = chat_template_kwargs
        self.corpus = Corpus(paths, validate=validate, bad_records=bad_records)
        if self.corpus.first_chat_record is not None:
            check_chat_tokenizer(tokenizer, self.corpus.first_chat_record)

        self._packer = RowPacker(capacity)
        self._completed: collections.deque[PackedRow] = collections.deque()
        self._next_document = Cursor(0, 0)
        self._rows_emitted = 0
        self._documents_read = 0
        self._split_documents = 0
        self._order_epoch, self._order = -1, np.empty(0, np.int64)
        if state is not None:
            self._restore(state)

    # -- resume ---------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position of the next batch; pass it as `state=` to continue exactly there."""
        if self._completed:
            start = self._completed[0].start
        elif self._packer.open_start is not None:
            start = self._packer.open_start
        else:
            start = self._next_document
        return {
            "version": STATE_VERSION,
            "epoch": start.epoch,
            "document": start.document,
            "token_offset": start.token_offset,
            "rows": self._rows_emitted,
            # Checked on restore: a cursor only means something for the same corpus, order and row layout.
            "num_records": len(self.corpus),
            "seed": self.seed,
            "seq_len": self.seq_len,
            "anchor_stride": self.anchor_stride,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        expected = {"version": STATE_VERSION, "num_records": len(self.corpus), "seed": self.seed,
                    "seq_len": self.seq_len, "anchor_stride": self.anchor_stride}
        for key, value in expected.items():
            if state.get(key) != value:
                raise DataError("loader state", f"{key} is {state.get(key)!r} in the saved state but {value!r} "
                                                "now; the saved position does not apply to this data/config")
        self._next_document = Cursor(int(state["epoch"]), int(state["document"]), int(state["token_offset"]))
        self._rows_emitted = int(state["rows"])

    # -- iteration ------------------------------------------------------------------------------------------

    def __next__(self) -> dict[str, np.ndarray]:
        rows: list[PackedRow | None] = []
        while len(rows) < self.batch_size and (row := self._next_row()) is not None:
            rows.append(row)
        if not rows:
            raise StopIteration
        real_rows = len(rows)
        rows += [None] * (self.batch_size - real_rows)  # only at the end of a finite stream
        placed = [
            place_row(row, self.seq_len, row_phase(self.seed, self._rows_emitted + i, self.anchor_stride), self.pad_id)
            for i, row in enumerate(rows)
        ]
        self._rows_emitted += real_rows
        return {key: np.stack([p[key] for p in placed]) for key in ROW_KEYS}

    def stats(self) -> dict[str, int]:
        """Counters for logging; `rows` survives resume, the others count since construction."""
        return {
            "epoch": self.state()["epoch"],
            "rows": self._rows_emitted,
            "documents_read": self._documents_read,
            "split_documents": self._split_documents,
            "skipped_records": self.corpus.skipped_records,
        }

    def close(self) -> None:
        self.corpus.close()

    def _next_row(self) -> PackedRow | None:
        while not self._completed:
            item = self._read_document()
            if item is None:
                return self._packer.flush()
            self._completed.extend(self._packer.add(*item))
        return self._completed.popleft()

    def _read_document(self) -> tuple[Document, Cursor] | None:
        """The next tokenized document and its cursor, or None at the end of the last epoch."""
        while True:
            cursor = self._next_document
            if self.num_epochs is not None and cursor.epoch >= self.num_epochs:
                return None
            if cursor.document >= len(self.corpus):
                self._next_document = Cursor(cursor.epoch + 1, 0)
                continue
            self._next_document = Cursor(cursor.epoch, cursor.document + 1)
            index = int(self._epoch_order(cursor.epoch)[cursor.document])
            where = self.corpus.where(index)
            try:
                document = tokenize_record(self.corpus.read(index), self.tokenizer, where, self.chat_template_kwargs)
            except DataError as e:
                self.corpus.report_bad_record(e)
                continue
            self._documents_read += 1
            if len(document) > self._packer.capacity:
                self._report_split(where, len(document))
            return self._resume_slice(document, cursor, where), cursor

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.corpus))
            self._order_epoch = epoch
        return self._order

    def _resume_slice(self, document: Document, cursor: Cursor, where: str) -> Document:
        """The part of `document` from `cursor.token_offset` (non-zero only when resuming inside a split one)."""
        if cursor.token_offset == 0:
            return document
        if cursor.token_offset >= len(document):
            raise DataError(where, f"resume offset {cursor.token_offset} is past the document's {len(document)} "
                                   "tokens; the corpus or tokenizer changed since the state was saved")
        return Document(document.input_ids[cursor.token_offset :], document.loss_mask[cursor.token_offset :])

    def _report_split(self, where: str, length: int) -> None:
        capacity = self._packer.capacity
        message = "%s: document of %d tokens exceeds the row capacity of %d; split into %d rows (positions continue)"
        # Warn once so the user knows it happens; the count is in stats(), per-document detail at debug level.
        level = logging.WARNING if self._split_documents == 0 else logging.DEBUG
        log.log(level, message, where, length, capacity, -(-length // capacity))
        self._split_documents += 1
