"""One row of every batch: its own share of the corpus, shuffled per epoch, packed greedily into rows.

Row r of every global batch comes from stream r, which reads only row r's share of the corpus (the records that
start in range r of `batch_size` equal ranges of every source, data/corpus.py), each epoch in its own order
seeded by (seed, epoch, r). The document stream runs across epochs without a break and never ends. Since a stream
depends on nothing but its row index, a host builds exactly the rows its devices hold, and the saved
position (one cursor per row) resumes on any number of hosts.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_jax.data.corpus import Corpus
from dflash_jax.data.packing import Cursor, PackedRow, RowPacker, packed_length
from dflash_jax.data.tokenize import Document, tokenize_record
from dflash_jax.runtime.errors import DataError


class RowStream:
    """Packed rows of batch row `row` from `corpus` (that row's share), in order; `position` / `restore`
    save and reload the point of the next row.

    on_split(where, length): called for every document longer than a row (it is split into overlapping pieces,
        data/packing.py; positions continue).
    max_positions: the target's max_position_embeddings; a longer document keeps only its first
        `max_positions` tokens, and on_truncate(where, length) is called (None: no limit).
    """

    def __init__(self, corpus: Corpus, row: int, *, seed: int, capacity: int, tokenizer: PreTrainedTokenizerBase,
                 chat_template_kwargs: dict[str, Any] | None, on_split: Callable[[str, int], None],
                 max_positions: int | None = None, on_truncate: Callable[[str, int], None] | None = None):
        self.corpus, self.row, self.seed = corpus, row, seed
        self.tokenizer, self.chat_template_kwargs, self._on_split = tokenizer, chat_template_kwargs, on_split
        self._max_positions, self._on_truncate = max_positions, on_truncate
        self._packer = RowPacker(capacity)
        self._completed: collections.deque[PackedRow] = collections.deque()
        self._next_document = Cursor(0, 0)
        self._order_epoch, self._order = -1, np.empty(0, np.int64)
        self.documents_read = 0

    def position(self) -> dict[str, int]:
        """JSON-serialisable point of the next row: the cursor of its first piece."""
        if self._completed:
            start = self._completed[0].start
        elif self._packer.open_start is not None:
            start = self._packer.open_start
        else:
            start = self._next_document
        # `records` is checked on restore: a cursor only means something for the same share of the corpus.
        return {"epoch": start.epoch, "document": start.document, "token_offset": start.token_offset,
                "records": self.corpus.epoch_length}

    def restore(self, position: dict[str, int]) -> None:
        if position.get("records") != self.corpus.epoch_length:
            raise DataError("loader state", f"an epoch of row {self.row}'s share of the corpus has "
                                            f"{self.corpus.epoch_length} records "
                                            f"but {position.get('records')!r} in the saved state; the saved "
                                            "position does not apply to this data")
        self._next_document = Cursor(int(position["epoch"]), int(position["document"]),
                                     int(position["token_offset"]))

    def token_count(self) -> float:
        """Tokens one epoch of this stream draws: each record's document (cut to max_positions as reading cuts
        it, with the context its split pieces repeat) times its source's weight (data/corpus.py), in one
        tokenization pass over the share. A record that
        fails to tokenize counts 0 and is left for reading to report, so the bad-record policy applies once."""
        total = 0.0
        for index in range(len(self.corpus)):
            try:
                length = len(self._tokenize(index))
            except DataError:
                continue
            length = length if self._max_positions is None else min(length, self._max_positions)
            total += self.corpus.weight(index) * packed_length(length, self._packer.capacity)
        return total

    def next_row(self) -> PackedRow:
        while not self._completed:
            self._completed.extend(self._packer.add(*self._read_document()))
        return self._completed.popleft()

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which epoch `epoch` visits this stream's records."""
        if epoch != self._order_epoch:
            self._order = self.corpus.epoch_order(self.seed, epoch, self.row)
            self._order_epoch = epoch
        return self._order

    def _read_document(self) -> tuple[Document, Cursor]:
        """The next tokenized document and its cursor."""
        while True:
            cursor = self._next_document
            if cursor.document >= self.corpus.epoch_length:
                self._next_document = Cursor(cursor.epoch + 1, 0)
                continue
            self._next_document = Cursor(cursor.epoch, cursor.document + 1)
            index = int(self.epoch_order(cursor.epoch)[cursor.document])
            try:
                document = self._tokenize(index)
            except DataError as e:
                self.corpus.report_bad_record(e)
                continue
            self.documents_read += 1
            if self._max_positions is not None and len(document) > self._max_positions:
                self._on_truncate(self.corpus.byte_location(index), len(document))
                document = Document(document.input_ids[: self._max_positions],
                                    document.loss_mask[: self._max_positions])
            if len(document) > self._packer.capacity:
                self._on_split(self.corpus.byte_location(index), len(document))
            return self._resume_slice(document, cursor, index), cursor

    def _tokenize(self, index: int) -> Document:
        record = self.corpus.read(index)
        try:
            return tokenize_record(record, self.tokenizer, "", self.chat_template_kwargs)
        except DataError as e:  # the record's `path:line` is worked out only for a message
            raise DataError(self.corpus.where(index), e.reason) from None

    def _resume_slice(self, document: Document, cursor: Cursor, index: int) -> Document:
        """The part of `document` from `cursor.token_offset` (non-zero only when resuming inside a split one)."""
        if cursor.token_offset == 0:
            return document
        if cursor.token_offset >= len(document):
            raise DataError(self.corpus.where(index), f"resume offset {cursor.token_offset} is past the "
                            f"document's {len(document)} tokens; the corpus or tokenizer changed since the state "
                            "was saved")
        return Document(document.input_ids[cursor.token_offset :], document.loss_mask[cursor.token_offset :])
