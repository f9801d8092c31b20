"""Greedy packing of documents into rows, and placing a row's content at its anchor-grid phase (design §4).

A row of T tokens holds content of at most `capacity = T - (S - 1)` tokens, so that shifting it right by any
phase p in [0, S) still fits. Documents are never split across rows when they fit in one: a document that
does not fit in the open row starts the next row. A document longer than `capacity` (an agent trace longer than
a row) is cut into capacity-sized pieces, each starting a row, that overlap: every piece after the first starts
with the last `capacity // 2` tokens of the one before as context, their loss mask 0, so each trained token is
read with at least half a row of the document before it and no token is trained twice (design §4). Pieces start
at multiples of `capacity - capacity // 2`; positions continue across pieces so RoPE sees the true positions.

Every row remembers the `Cursor` of its first piece, which is all a resumed loader needs to rebuild the
same rows: packing is deterministic given the document stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_jax.data.tokenize import Document

ROW_KEYS = ("input_ids", "positions", "segment_ids", "loss_mask")


@dataclass(frozen=True)
class Cursor:
    """A point in the document stream: document `document` of epoch `epoch`'s order, from token `token_offset`
    (non-zero only inside a split document, always a multiple of `RowPacker.split_step`)."""

    epoch: int
    document: int
    token_offset: int = 0


@dataclass(frozen=True)
class PackedRow:
    """Unpadded row content, each array int32 of the same length <= capacity. Segment ids start at 1."""

    input_ids: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    start: Cursor

    def __len__(self) -> int:
        return len(self.input_ids)


def row_capacity(seq_len: int, anchor_stride: int) -> int:
    """Content tokens per row: room for a left shift of up to `anchor_stride - 1` padding tokens."""
    if anchor_stride < 1 or seq_len < anchor_stride:
        raise ValueError(f"need 1 <= anchor_stride <= seq_len, got anchor_stride={anchor_stride} seq_len={seq_len}")
    return seq_len - (anchor_stride - 1)


def split_context(capacity: int) -> int:
    """Tokens of the document before it that a split document's later pieces start with (loss mask 0)."""
    return capacity // 2


def packed_length(length: int, capacity: int) -> int:
    """Tokens a document of `length` takes in rows: itself, plus the context its later pieces repeat."""
    step = capacity - split_context(capacity)
    later_pieces = max(0, -(-(length - capacity) // step))
    return length + later_pieces * split_context(capacity)


class RowPacker:
    """Accumulates document pieces into an open row; `add` returns the rows it completed."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.split_step = capacity - split_context(capacity)  # where a split document's pieces start
        self._pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, positions, loss_mask)
        self._open_length = 0
        self._open_start: Cursor | None = None

    @property
    def open_start(self) -> Cursor | None:
        """Cursor of the open (incomplete) row's first piece, None when the open row is empty."""
        return self._open_start

    def add(self, document: Document, cursor: Cursor) -> list[PackedRow]:
        """Add `document` (already sliced from `cursor.token_offset`) and return the rows completed by it."""
        if len(document) == 0:
            raise ValueError(f"empty document at {cursor}")
        completed = []
        piece_start = 0
        while True:
            piece = slice(piece_start, piece_start + self.capacity)
            ids, loss_mask = document.input_ids[piece], document.loss_mask[piece]
            first_position = cursor.token_offset + piece_start
            if first_position > 0:  # a later piece of a split document: its first tokens are context only
                loss_mask = loss_mask.copy()
                loss_mask[: split_context(self.capacity)] = 0
            if self._open_length + len(ids) > self.capacity:
                completed.append(self._close())
            if self._open_start is None:
                self._open_start = Cursor(cursor.epoch, cursor.document, first_position)
            positions = np.arange(first_position, first_position + len(ids), dtype=np.int32)
            self._pieces.append((ids, positions, loss_mask))
            self._open_length += len(ids)
            if piece_start + self.capacity >= len(document):
                return completed
            piece_start += self.split_step

    def flush(self) -> PackedRow | None:
        """Close and return the open row, if it has any content (end of a finite stream)."""
        return self._close() if self._pieces else None

    def _close(self) -> PackedRow:
        segment_ids = [np.full(len(ids), segment, np.int32) for segment, (ids, _, _) in enumerate(self._pieces, 1)]
        row = PackedRow(
            input_ids=np.concatenate([ids for ids, _, _ in self._pieces]).astype(np.int32),
            positions=np.concatenate([positions for _, positions, _ in self._pieces]),
            segment_ids=np.concatenate(segment_ids),
            loss_mask=np.concatenate([mask for _, _, mask in self._pieces]).astype(np.int32),
            start=self._open_start,
        )
        self._pieces, self._open_length, self._open_start = [], 0, None
        return row


def row_phase(seed: int, row_index: int, anchor_stride: int) -> int:
    """Phase of global row `row_index`: uniform in [0, S), a pure function of (seed, row index) for exact resume."""
    # The constant separates this random stream from the shuffle's (seed, epoch) stream.
    return int(np.random.default_rng([seed, 0x9A5E, row_index]).integers(anchor_stride))


def place_row(row: PackedRow | None, seq_len: int, phase: int, pad_id: int) -> dict[str, np.ndarray]:
    """A [T] int32 array per key with the content starting at `phase`; None gives an all-padding row.

    Padding: input_ids = pad_id, positions 0, segment_ids 0 (real documents are 1, 2, ...), loss_mask 0.
    """
    placed = {key: np.zeros(seq_len, np.int32) for key in ROW_KEYS}
    placed["input_ids"][:] = pad_id
    if row is not None:
        if phase + len(row) > seq_len:
            raise ValueError(f"row of {len(row)} tokens at phase {phase} does not fit in seq_len {seq_len}")
        for key in ROW_KEYS:
            placed[key][phase : phase + len(row)] = getattr(row, key)
    return placed
