"""Per-host data: a loader of some rows of the global batch builds exactly those rows of the whole batch's
loader, from only their shares of the corpus; the data position resumes on any number of hosts; the
prefetch thread hands out the same batches with the position after each."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.data import BatchLoader, Prefetcher, merge_states
from dflash_jax.runtime.errors import DataError
from tests.data_fixtures import completion_records, write_jsonl
from tests.tokenizer_fixture import make_chat_tokenizer

BATCH = 8
OPTIONS = dict(seq_len=48, anchor_stride=8, batch_size=BATCH, seed=3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """Two files; long documents, so rows and resume points fall inside split documents."""
    root = tmp_path_factory.mktemp("sharding")
    return [write_jsonl(root / "a.jsonl", completion_records(60, seed=1, max_words=60)),
            write_jsonl(root / "b.jsonl", completion_records(40, seed=2))]


def loader(paths: list[Path], rows=None, state=None, **overrides) -> BatchLoader:
    return BatchLoader(paths, make_chat_tokenizer(), rows=rows, state=state, **{**OPTIONS, **overrides})


def hosts(count: int) -> list[list[int]]:
    """The rows each of `count` hosts holds, as the batch sharding splits them."""
    return [list(range(h * BATCH // count, (h + 1) * BATCH // count)) for h in range(count)]


def joined(loaders: list[BatchLoader]) -> dict[str, np.ndarray]:
    """The next global batch, from the loaders of all hosts."""
    parts = [next(part) for part in loaders]
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_each_host_builds_its_rows_of_the_whole_batch_from_its_share_only(corpus):
    whole = loader(corpus)
    for count in (2, 4, 8):
        parts = [loader(corpus, rows) for rows in hosts(count)]
        # Every record is indexed by exactly one host; none indexes the whole corpus.
        assert sum(part.num_records for part in parts) == whole.num_records == 100
        assert max(part.num_records for part in parts) < whole.num_records
        reference = loader(corpus)
        for _ in range(12):
            assert_same(joined(parts), next(reference))
    # Rows need not be contiguous: rows 1 and 6 of the batch are rows 1 and 6 of the whole batch.
    some, reference = loader(corpus, [6, 1]), loader(corpus)
    for _ in range(5):
        batch, full = next(some), next(reference)
        assert_same(batch, {key: value[[1, 6]] for key, value in full.items()})


@pytest.mark.parametrize("saved_on, resumed_on", [(1, 2), (2, 1), (2, 4), (8, 2)])
def test_the_data_position_resumes_on_another_number_of_hosts(corpus, saved_on, resumed_on):
    before = [loader(corpus, rows) for rows in hosts(saved_on)]
    for _ in range(9):
        joined(before)
    # What a checkpoint holds: the hosts' positions joined, through JSON.
    state = json.loads(json.dumps(merge_states([part.state() for part in before])))
    assert sorted(map(int, state["rows"])) == list(range(BATCH)) and state["batches"] == 9
    after = [loader(corpus, rows, state) for rows in hosts(resumed_on)]
    for _ in range(15):
        assert_same(joined(after), joined(before))


def test_a_position_from_other_data_or_another_batch_size_is_refused(corpus, tmp_path):
    state = merge_states([loader(corpus).state()])
    with pytest.raises(DataError, match="batch_size is 8 in the saved state but 4 now"):
        loader(corpus, state=state, batch_size=4)
    grown = write_jsonl(tmp_path / "b.jsonl", completion_records(41, seed=2))
    with pytest.raises(DataError, match="corpus_bytes is"):
        loader([corpus[0], grown], state=state)
    with pytest.raises(DataError, match="the saved position has no row 5"):
        loader(corpus, [5], state=loader(corpus, [0, 1]).state())


def test_each_host_validates_its_share_and_names_the_line(tmp_path):
    lines = completion_records(20)
    lines[16] = "not json"  # line 17, in the last rows' share
    path = write_jsonl(tmp_path / "corpus.jsonl", lines)
    assert loader([path], [0, 1], batch_size=4).num_records > 0  # the first rows' share is clean
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:17: invalid JSON"):
        loader([path], [2, 3], batch_size=4)


def test_a_corpus_too_small_for_the_batch_is_one_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "corpus.jsonl", completion_records(3))
    with pytest.raises(DataError, match=r"no record starts in bytes \[\d+, \d+\), the share of batch row \d+: .* too "
                                        r"few for batch_size 8"):
        loader([path])


def test_prefetch_hands_out_the_batches_with_the_position_after_each(corpus):
    reference, prefetched = loader(corpus, [2, 3]), Prefetcher(loader(corpus, [2, 3]), depth=3)
    for _ in range(6):
        batch, position = next(prefetched)
        assert_same(batch, next(reference))
        assert position == reference.state()
    prefetched.close()
    assert not any(thread.name == "batch-prefetch" and thread.is_alive() for thread in threading.enumerate())


def test_prefetch_raises_the_loaders_error_at_the_batch_that_needs_the_bad_record(tmp_path):
    lines = completion_records(16)
    lines[3] = {"prompt": "a", "completion": 7}  # found only at tokenization, since validation is off
    path = write_jsonl(tmp_path / "corpus.jsonl", lines)
    prefetched = Prefetcher(loader([path], batch_size=1, validate=False))
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:4: 'completion' must be a string"):
        for _ in range(16):
            next(prefetched)
    with pytest.raises(DataError):  # and again: the stream does not go on past the error
        next(prefetched)
    prefetched.close()


def test_a_position_saved_before_sources_resumes_only_a_single_file(corpus):
    # Version 2 states came from one share of the concatenated files per row: the same layout for one file.
    reference = loader(corpus[:1])
    for _ in range(4):
        next(reference)
    old = {**reference.state(), "version": 2}
    del old["sources"]
    resumed = loader(corpus[:1], state=old)
    for _ in range(5):
        assert_same(next(resumed), next(reference))
    two = loader(corpus)
    old_two = {**two.state(), "version": 2}
    del old_two["sources"]
    with pytest.raises(DataError, match="version is 2 in the saved state but 3 now"):
        loader(corpus, state=old_two)
    with pytest.raises(DataError, match=r"sources is \[\[\d+, 1.0\], \[\d+, 1.0\]\] in the saved state but "):
        loader([f"{corpus[0]}@1", f"{corpus[1]}@2"], state=two.state())
