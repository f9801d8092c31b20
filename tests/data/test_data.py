"""Records, tokenization, packing and the streaming, resumable batch loader (dflash_jax.data)."""

from __future__ import annotations

import json
import logging
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.data import (
    BatchLoader,
    ChatRecord,
    CompletionRecord,
    Cursor,
    Document,
    RowPacker,
    packed_length,
    parse_object,
    place_row,
    row_capacity,
    tokenize_record,
)
from dflash_jax.runtime.errors import DataError
from tests.data_fixtures import completion_records, make_loader, row_documents, write_jsonl
from tests.tokenizer_fixture import make_chat_tokenizer

SYSTEM_USER_ASSISTANT = [
    {"role": "system", "content": "You are a helpful model."},
    {"role": "user", "content": "Please explain the anchor grid?"},
    {"role": "assistant", "content": "The anchor grid is static.\nIt has a phase."},
]
TWO_ASSISTANT_TURNS = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is a block?"},
    {"role": "assistant", "content": "A block is a draft of tokens."},
    {"role": "user", "content": "And a row?"},
    {"role": "assistant", "content": "A row is packed documents."},
]


def trained_runs(document: Document) -> list[np.ndarray]:
    """The token ids of each maximal run of loss_mask == 1."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], document.loss_mask, [0]])))
    return [document.input_ids[start:end] for start, end in zip(edges[::2], edges[1::2])]


# -- tokenization -------------------------------------------------------------------------------------------


def test_chat_loss_mask_is_exactly_the_assistant_tokens():
    tokenizer = make_chat_tokenizer()
    document = tokenize_record(ChatRecord(tuple(SYSTEM_USER_ASSISTANT)), tokenizer, "t:1")
    expected_ids = tokenizer.apply_chat_template(SYSTEM_USER_ASSISTANT, tokenize=False)
    assert document.input_ids.tolist() == tokenizer(expected_ids, add_special_tokens=False)["input_ids"]
    runs = trained_runs(document)
    assert len(runs) == 1
    assert tokenizer.decode(runs[0]) == SYSTEM_USER_ASSISTANT[2]["content"] + "<|im_end|>"
    untrained = tokenizer.decode(document.input_ids[document.loss_mask == 0])
    assert untrained == (
        "<|im_start|>system\nYou are a helpful model.<|im_end|>\n<|im_start|>user\n"
        "Please explain the anchor grid?<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_chat_loss_mask_covers_both_assistant_turns_of_a_multi_turn_chat():
    tokenizer = make_chat_tokenizer()
    document = tokenize_record(ChatRecord(tuple(TWO_ASSISTANT_TURNS)), tokenizer, "t:1")
    runs = [tokenizer.decode(run) for run in trained_runs(document)]
    assert runs == [TWO_ASSISTANT_TURNS[2]["content"] + "<|im_end|>", TWO_ASSISTANT_TURNS[4]["content"] + "<|im_end|>"]


def test_completion_record_trains_exactly_the_completion_tokens():
    tokenizer = make_chat_tokenizer()
    document = tokenize_record(CompletionRecord("def f(x):\n", "    return x + 1\n"), tokenizer, "t:1")
    prompt_ids = tokenizer("def f(x):\n", add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer("    return x + 1\n", add_special_tokens=False)["input_ids"]
    assert document.input_ids.tolist() == prompt_ids + completion_ids
    assert document.loss_mask.tolist() == [0] * len(prompt_ids) + [1] * len(completion_ids)
    assert document.input_ids.dtype == np.int32 and document.loss_mask.dtype == np.int32


def test_template_that_rewrites_earlier_turns_is_located_in_the_whole_rendering():
    # Renders the last assistant turn differently from earlier ones, as the Qwen reasoning templates do: the
    # rendering of a prefix is no prefix of the whole one, and the turns are still found in the whole one.
    tokenizer = make_chat_tokenizer()
    tokenizer.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{%- if m['role'] == 'assistant' and loop.last %}<|endoftext|>{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    document = tokenize_record(ChatRecord(tuple(TWO_ASSISTANT_TURNS)), tokenizer, "t:7")
    runs = [tokenizer.decode(run) for run in trained_runs(document)]
    assert runs == [TWO_ASSISTANT_TURNS[2]["content"] + "<|im_end|>",
                    "<|endoftext|>" + TWO_ASSISTANT_TURNS[4]["content"] + "<|im_end|>"]


# -- bad records --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"messages": [', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "hi"}', "record needs 'messages', 'conversations' or 'prompt'"),
        ('{"prompt": "hi"}', "record is missing 'completion'"),
        ('{"prompt": "hi", "completion": 3}', "'completion' must be a string"),
        ('{"prompt": "hi", "completion": ""}', "'completion' is empty"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "conversation has no assistant turn"),
        ('{"messages": [{"role": "assistant"}]}', r"messages\[0\] is missing 'content'"),
        ('{"messages": [{"role": "assistant", "content": 3}]}', r"messages\[0\].content must be a string or a list"),
    ],
)
def test_bad_record_reports_file_and_line(tmp_path: Path, bad_line: str, reason: str):
    good = completion_records(2)
    path = write_jsonl(tmp_path / "corpus.jsonl", [good[0], "", bad_line, good[1]])  # bad record on line 3
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: {reason}"):
        make_loader([path])


def test_bad_records_can_be_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = write_jsonl(tmp_path / "corpus.jsonl", [*completion_records(3), "not json"])
    with caplog.at_level(logging.WARNING):
        loader = make_loader([path], bad_records="skip", batch_size=1)
    assert loader.num_records == 3 and loader.stats()["skipped_records"] == 1
    assert f"{path}:4: invalid JSON" in caplog.text


def test_chat_records_need_a_tokenizer_with_a_chat_template(tmp_path: Path):
    path = write_jsonl(tmp_path / "chat.jsonl", [*completion_records(1), {"messages": SYSTEM_USER_ASSISTANT}])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: 'messages' record needs a tokenizer with a chat template"):
        BatchLoader([path], make_chat_tokenizer(with_chat_template=False), seq_len=64, anchor_stride=8, batch_size=2)
    # Without the up-front validation pass the same error comes when the record is tokenized.
    with pytest.raises(DataError, match=r"needs a tokenizer with a chat template"):
        tokenize_record(ChatRecord(tuple(SYSTEM_USER_ASSISTANT)), make_chat_tokenizer(with_chat_template=False), "x:1")


# -- packing ------------------------------------------------------------------------------------------------


def synthetic_documents(lengths: list[int]) -> list[Document]:
    """Document d is all token d+1, so every token says which document it came from."""
    return [Document(np.full(n, d + 1, np.int32), np.ones(n, np.int32)) for d, n in enumerate(lengths)]


def test_packing_never_splits_a_document_that_fits_and_is_greedy():
    capacity = 57
    lengths = np.random.default_rng(0).integers(1, capacity + 1, size=300).tolist()
    packer, rows = RowPacker(capacity), []
    for d, document in enumerate(synthetic_documents(lengths)):
        rows += packer.add(document, Cursor(0, d))
    rows.append(packer.flush())
    assert sum(len(row) for row in rows) == sum(lengths)
    seen = []
    for row, next_row in zip(rows, rows[1:] + [None]):
        assert len(row) <= capacity
        for segment in np.unique(row.segment_ids):
            ids = row.input_ids[row.segment_ids == segment]
            assert len(ids) == lengths[ids[0] - 1] and (ids == ids[0]).all()  # the whole document, in one row
            assert row.positions[row.segment_ids == segment].tolist() == list(range(len(ids)))
            seen.append(int(ids[0]))
        if next_row is not None:  # greedy: a row closes only because the next document did not fit
            assert len(row) + lengths[next_row.input_ids[0] - 1] > capacity
    assert seen == list(range(1, len(lengths) + 1))


def test_long_document_is_split_into_overlapping_rows_each_token_trained_once():
    packer = RowPacker(capacity=10)
    short, long_doc, after = synthetic_documents([4, 25, 3])
    rows = packer.add(short, Cursor(0, 0)) + packer.add(long_doc, Cursor(0, 1)) + packer.add(after, Cursor(0, 2))
    rows.append(packer.flush())
    # Pieces of 10 starting every 5 tokens: each after the first repeats the 5 before as context (loss mask 0).
    assert [len(r) for r in rows] == [4, 10, 10, 10, 10, 3]
    assert [r.start for r in rows] == [Cursor(0, 0), Cursor(0, 1, 0), Cursor(0, 1, 5), Cursor(0, 1, 10),
                                       Cursor(0, 1, 15), Cursor(0, 2)]
    assert [r.positions.tolist() for r in rows[1:5]] == [list(range(s, s + 10)) for s in (0, 5, 10, 15)]
    assert [r.loss_mask.tolist() for r in rows[2:5]] == [[0] * 5 + [1] * 5] * 3
    trained = np.concatenate([r.positions[(r.input_ids == 2) & (r.loss_mask == 1)] for r in rows])
    assert trained.tolist() == list(range(25))  # every token trained exactly once, none dropped
    assert sum(len(r) for r in rows[1:5]) == packed_length(25, 10)


def test_a_split_documents_prompt_stays_untrained_in_its_later_pieces():
    # loss mask 0 on a prompt of 12 tokens, 1 after: the context rule never turns a prompt token on.
    document = Document(np.arange(1, 31, dtype=np.int32), (np.arange(30) >= 12).astype(np.int32))
    packer = RowPacker(capacity=10)
    rows = packer.add(document, Cursor(0, 0)) + [packer.flush()]
    trained = np.concatenate([r.positions[r.loss_mask == 1] for r in rows])
    assert trained.tolist() == list(range(12, 30))


def test_place_row_shifts_content_by_the_phase_and_pads_with_segment_zero():
    packer = RowPacker(capacity=row_capacity(16, 4))
    packer.add(Document(np.array([7, 8, 9], np.int32), np.array([0, 1, 1], np.int32)), Cursor(0, 0))
    placed = place_row(packer.flush(), seq_len=16, phase=3, pad_id=5)
    assert placed["input_ids"].tolist() == [5, 5, 5, 7, 8, 9] + [5] * 10
    assert placed["positions"].tolist() == [0, 0, 0, 0, 1, 2] + [0] * 10
    assert placed["segment_ids"].tolist() == [0, 0, 0, 1, 1, 1] + [0] * 10
    assert placed["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1] + [0] * 10


# -- the loader ---------------------------------------------------------------------------------------------


def test_loader_batches_have_restarting_positions_padding_segment_zero_and_a_phase(tmp_path: Path):
    path = write_jsonl(tmp_path / "corpus.jsonl", completion_records(200) + [{"messages": TWO_ASSISTANT_TURNS}] * 20)
    loader = make_loader([path], seq_len=128, anchor_stride=8, batch_size=4)
    phases = []
    for _ in range(20):
        batch = next(loader)
        assert set(batch) == {"input_ids", "positions", "segment_ids", "loss_mask"}
        for value in batch.values():
            assert value.shape == (4, 128) and value.dtype == np.int32
        padding = batch["segment_ids"] == 0
        assert (batch["input_ids"][padding] == 0).all() and (batch["loss_mask"][padding] == 0).all()
        assert (batch["positions"][padding] == 0).all()
        for row in range(4):
            real = np.flatnonzero(~padding[row])
            phases.append(real[0])
            assert real[-1] - real[0] + 1 == len(real) <= row_capacity(128, 8)  # one contiguous block of content
            for document in row_documents(batch, row):
                assert document["positions"].tolist() == list(range(len(document["positions"])))
    assert set(phases) == set(range(8))  # every phase in [0, S) occurs
    assert loader.stats()["split_documents"] == 0  # so every document starts at position 0


def test_loader_splits_long_documents_and_counts_them(tmp_path: Path):
    path = write_jsonl(tmp_path / "corpus.jsonl", completion_records(30, max_words=200))
    loader = make_loader([path], seq_len=32, anchor_stride=8)
    tokens = sum(int((next(loader)["segment_ids"] > 0).sum()) for _ in range(30))
    assert tokens > 0 and loader.stats()["split_documents"] > 0


def test_the_loader_counts_every_token_the_targets_positions_cut(tmp_path: Path):
    records = completion_records(12, max_words=120)
    path = write_jsonl(tmp_path / "corpus.jsonl", records)
    loader = make_loader([path], seq_len=32, anchor_stride=8, batch_size=1, max_positions=40)
    lengths = [len(tokenize_record(parse_object(r, "r"), make_chat_tokenizer(), "r")) for r in records]
    for _ in range(20):
        next(loader)
    stream, read = loader.streams[0], loader.stats()["documents_read"]
    order = np.concatenate([stream.epoch_order(epoch) for epoch in range(read // len(records) + 1)])[:read]
    cut = [lengths[index] - 40 for index in order if lengths[index] > 40]
    assert cut and loader.stats()["truncated_documents"] == len(cut)
    assert loader.stats()["truncated_tokens"] == sum(cut)


def test_every_epoch_visits_every_record_once(tmp_path: Path):
    # Row r of every batch reads its own share of the corpus: each epoch of that row is a permutation of
    # the share, and the shares of the rows split the corpus.
    records = [{"prompt": "", "completion": f" record {i} " + r["completion"]} for i, r in enumerate(completion_records(50))]
    path = write_jsonl(tmp_path / "corpus.jsonl", records)
    tokenizer = make_chat_tokenizer()
    loader = make_loader([path], seq_len=128, anchor_stride=8, batch_size=3)
    batches = [next(loader) for _ in range(40)]
    shares = []
    for row, stream in enumerate(loader.streams):
        texts = [tokenizer.decode(doc["input_ids"]) for b in batches for doc in row_documents(b, row)]
        share = len(stream.corpus)
        assert len(texts) >= 2 * share + 1, "the test needs two whole epochs of every row"
        assert sorted(texts[:share]) == sorted(texts[share : 2 * share]) and texts[:share] != texts[share : 2 * share]
        shares.append(texts[:share])
    assert sorted(text for share in shares for text in share) == sorted(r["completion"] for r in records)


def batches_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_shuffle_is_deterministic_by_seed(tmp_path: Path):
    path = write_jsonl(tmp_path / "corpus.jsonl", completion_records(100))
    first, same, other = (make_loader([path], seed=s) for s in (1, 1, 2))
    for _ in range(5):
        a, b, c = next(first), next(same), next(other)
        assert batches_equal(a, b)
    assert not batches_equal(a, c)
    stream = first.streams[0]
    assert not np.array_equal(stream.epoch_order(0), stream.epoch_order(1))  # each epoch has its own order


def test_resume_from_state_gives_identical_following_batches(tmp_path: Path):
    # Two files, long documents (so resume points fall inside split documents) and several epochs.
    paths = [
        write_jsonl(tmp_path / "a.jsonl", completion_records(15, seed=1, max_words=120)),
        write_jsonl(tmp_path / "b.jsonl", completion_records(10, seed=2) + [{"messages": SYSTEM_USER_ASSISTANT}] * 5),
    ]
    reference = make_loader(paths, seq_len=48, anchor_stride=8, batch_size=3)
    states, batches = [], []
    for _ in range(90):  # split documents' overlapping pieces take more rows than their tokens alone
        states.append(json.loads(json.dumps(reference.state())))
        batches.append(next(reference))
    positions = [position for state in states for position in state["rows"].values()]
    assert any(p["token_offset"] > 0 for p in positions) and min(p["epoch"] for p in states[-1]["rows"].values()) >= 2
    for resume_at in (0, 1, 7, 23, 41, 59, 89):
        resumed = make_loader(paths, seq_len=48, anchor_stride=8, batch_size=3, state=states[resume_at])
        for expected in batches[resume_at:]:
            assert batches_equal(next(resumed), expected)


def test_resume_state_from_a_different_configuration_is_refused(tmp_path: Path):
    path = write_jsonl(tmp_path / "corpus.jsonl", completion_records(20))
    state = make_loader([path], seed=1).state()
    with pytest.raises(DataError, match="seed is 1 in the saved state but 2 now"):
        make_loader([path], seed=2, state=state)


def test_corpus_streams_from_disk_without_loading_it(tmp_path: Path):
    # ~3000 lines of ~2.7 kB: holding the text would need at least the file's size; the index pass and a few
    # batches must stay far below it (the index is ~20 bytes per record; the rest is tokenizer overhead).
    filler = "x" * 2600
    lines = [{"prompt": f"{filler} {i}", "completion": " the model"} for i in range(3000)]
    path = write_jsonl(tmp_path / "big.jsonl", lines)
    file_size = path.stat().st_size
    tokenizer = make_chat_tokenizer()
    tracemalloc.start()
    try:
        loader = BatchLoader([path], tokenizer, seq_len=1024, anchor_stride=8, batch_size=2)
        for _ in range(3):
            next(loader)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert loader.num_records == 3000 and file_size > 7_500_000
    assert peak < file_size / 4, f"peak Python memory {peak} bytes for a {file_size}-byte corpus"
