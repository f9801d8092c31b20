"""One batch row's share of the corpus: its part of every source, and the order an epoch visits it in.

Row r of a batch of B rows owns, of every source (data/sources.py), the records that start in the r-th of B
equal ranges of that source's units (bytes of a JSONL file, rows of a table), so the shares of the rows split
every source and a host indexes and reads only its rows' shares. An epoch of the row draws each record of a
source of weight w floor(w * n + 1/2) / n times over (n: the records of the source in the row's share): whole copies,
then a fresh seeded subset for the fraction, all of it in one seeded permutation. With every weight 1 an epoch
is a permutation of the share. Validation happens at indexing (data/jsonl.py, data/tables.py); the bad-record
policy is applied here.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from dflash_jax.data.records import Record
from dflash_jax.data.sources import WeightedSource, filesystem
from dflash_jax.runtime.errors import DataError
from dflash_jax.runtime.paths import is_url

log = logging.getLogger(__name__)


def check_input_files(paths: Sequence[str | os.PathLike], what: str) -> None:
    """DataError naming the path and `what` (the flag or config field) for a JSONL path that is missing, a
    directory or unreadable (the files read line by line: evaluation records, prompts)."""
    for path in paths:
        if is_url(path):
            fs, inside = filesystem(os.fspath(path), what)
            exists, is_dir, readable = fs.exists(inside), fs.isdir(inside), True  # unreadable: the read says so
        else:
            exists, is_dir, readable = os.path.exists(path), os.path.isdir(path), os.access(path, os.R_OK)
        if not exists:
            raise DataError(os.fspath(path), f"no such file ({what})")
        if is_dir:
            raise DataError(os.fspath(path), f"is a directory, not a JSONL file ({what})")
        if not readable:
            raise DataError(os.fspath(path), f"not readable by this user ({what})")


def share_range(units: int, row: int, batch_size: int) -> tuple[int, int]:
    """Row `row`'s range of a source of `units` units: its records are the ones that start there."""
    return row * units // batch_size, (row + 1) * units // batch_size


def _draws(weight: float, records: int) -> int:
    """Records an epoch draws from a share of `records` records of weight `weight`: w * n, rounded half up."""
    return math.floor(weight * records + 0.5)


class Corpus:
    """Record i of the row's share = record i - starts[s] of source s's share, for the s with starts[s] <= i.

    bad_records: "raise" aborts on the first invalid record with `path:line: reason` (or `path row N: ...`);
    "skip" logs that message as a warning, counts it in `skipped_records`, and leaves the record out (only
    meaningful with validate=True; records that fail later, at tokenization, get the same policy).
    progress: a shared progress bar (bytes of JSONL) for several shares indexed one after another.
    """

    def __init__(self, sources: Sequence[WeightedSource], row: int, batch_size: int, validate: bool = True,
                 bad_records: str = "raise", progress: tqdm | None = None):
        if bad_records not in ("raise", "skip"):
            raise ValueError(f"bad_records must be 'raise' or 'skip', got {bad_records!r}")
        self.bad_records, self.skipped_records = bad_records, 0
        self.ranges = [share_range(s.source.units, row, batch_size) for s in sources]
        own_bar = progress is None
        if own_bar:
            progress = tqdm(total=sum(hi - lo for (lo, hi), s in zip(self.ranges, sources) if s.source.unit == "bytes"),
                            unit="B", unit_scale=True, desc="indexing corpus")
        self.shares = [s.source.share(lo, hi, validate, self.report_bad_record, progress)
                       for s, (lo, hi) in zip(sources, self.ranges)]
        if own_bar:
            progress.close()
        self.weights = [s.weight for s in sources]
        self.starts = np.cumsum([0] + [len(share) for share in self.shares])
        firsts = [share.first_chat_record for share in self.shares if share.first_chat_record is not None]
        self.first_chat_record = firsts[0] if firsts else None  # `where` of the first chat record validated
        self._counts = [_draws(w, len(share)) for w, share in zip(self.weights, self.shares)]
        self.epoch_length = sum(self._counts)  # records one epoch of this row draws

    def report_bad_record(self, error: DataError) -> None:
        """Apply the bad-record policy: re-raise, or log and count."""
        if self.bad_records == "raise":
            raise error
        self.skipped_records += 1
        log.warning("skipping bad record: %s", error)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def epoch_order(self, seed: int, epoch: int, row: int) -> np.ndarray:
        """The records epoch `epoch` of row `row` visits, in order (indices of this corpus)."""
        permutation = np.random.default_rng([seed, epoch, row]).permutation
        if all(weight == 1 for weight in self.weights):
            return permutation(len(self))
        parts = []
        for s, (share, count) in enumerate(zip(self.shares, self._counts)):
            n, start = len(share), int(self.starts[s])
            if not count:
                continue
            copies, rest = divmod(count, n)
            parts += [np.arange(start, start + n)] * copies
            if rest:  # a fresh subset for the fractional part of the weight
                parts.append(start + np.random.default_rng([seed, epoch, row, s + 1]).permutation(n)[:rest])
        entries = np.concatenate(parts).astype(np.int64)
        return entries[permutation(len(entries))]

    def _locate(self, index: int) -> tuple[object, int]:
        s = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.shares[s], index - int(self.starts[s])

    def where(self, index: int) -> str:
        """`path:line` or `path row N` of record `index`: for messages about a bad record."""
        share, i = self._locate(index)
        return share.where(i)

    def byte_location(self, index: int) -> str:
        """Where record `index` is, free to compute: for messages that are not errors."""
        share, i = self._locate(index)
        return share.location(i)

    def weight(self, index: int) -> float:
        """The weight of record `index`'s source: the times an epoch draws it, on average."""
        return self.weights[int(np.searchsorted(self.starts, index, side="right")) - 1]

    def read(self, index: int) -> Record:
        """Read and parse record `index`."""
        share, i = self._locate(index)
        return share.read(i)

    def close(self) -> None:
        for share in self.shares:
            share.close()
