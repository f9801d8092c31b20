"""The static anchor grid (dflash_jax.ops.anchors) against a direct Python loop over the design §4 text."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.data import Cursor, Document, RowPacker, place_row, row_capacity
from dflash_jax.ops.anchors import (AnchorGrid, anchor_utilisation, anchor_validity, block_positions,
                                   block_token_ids, slot_mask)

MASK_TOKEN_ID = 999


def random_batch(seq_len: int, stride: int, batch: int, seed: int) -> dict[str, np.ndarray]:
    """Packed, phase-shifted rows of several documents, each a prompt (mask 0) then a completion (mask 1)."""
    rng = np.random.default_rng(seed)
    packer = RowPacker(row_capacity(seq_len, stride))
    rows = []
    for d in range(1000):
        length = int(rng.integers(2, seq_len // 2))
        prompt = int(rng.integers(0, length))
        document = Document(rng.integers(1, 500, length).astype(np.int32), (np.arange(length) >= prompt).astype(np.int32))
        rows += packer.add(document, Cursor(0, d))
        if len(rows) >= batch:
            break
    placed = [place_row(row, seq_len, int(rng.integers(stride)), pad_id=0) for row in rows[:batch]]
    return {key: np.stack([p[key] for p in placed]) for key in placed[0]}


def reference(batch: dict[str, np.ndarray], stride: int, block_size: int) -> dict[str, np.ndarray]:
    """design §4 read literally, one anchor and one slot at a time."""
    rows, seq_len = batch["input_ids"].shape
    n = seq_len // stride
    out = {
        "valid": np.zeros((rows, n), bool),
        "slots": np.zeros((rows, n, block_size), bool),
        "ids": np.zeros((rows, n * block_size), np.int32),
        "positions": np.zeros((rows, n * block_size), np.int32),
    }
    for r in range(rows):
        ids, positions, segments, loss = (batch[k][r] for k in ("input_ids", "positions", "segment_ids", "loss_mask"))
        for j in range(n):
            a = j * stride
            valid = a + 1 < seq_len and loss[a] == 1 and loss[a + 1] == 1
            out["valid"][r, j] = valid
            for k in range(block_size):
                out["slots"][r, j, k] = (
                    k >= 1 and valid and a + k < seq_len and segments[a + k] == segments[a] and loss[a + k] == 1
                )
                out["ids"][r, j * block_size + k] = ids[a] if k == 0 else MASK_TOKEN_ID
                out["positions"][r, j * block_size + k] = positions[a] + k
    return out


def grid_outputs(batch: dict[str, jax.Array | np.ndarray], anchors: np.ndarray, block_size: int) -> dict[str, jax.Array]:
    valid = anchor_validity(batch["loss_mask"], anchors)
    return {
        "valid": valid,
        "slots": slot_mask(batch["loss_mask"], batch["segment_ids"], anchors, block_size),
        "ids": block_token_ids(batch["input_ids"], anchors, block_size, MASK_TOKEN_ID),
        "positions": block_positions(batch["positions"], anchors, block_size),
        "utilisation": anchor_utilisation(valid),
    }


# (T, S, B): blocks shorter than, equal to and longer than the stride, so slots run past documents and past
# the end of the row; S = 1 puts an anchor on the last token, whose a+1 is outside the row.
@pytest.mark.parametrize("seq_len, stride, block_size", [(64, 8, 4), (64, 8, 16), (48, 4, 4), (40, 1, 3), (32, 16, 24)])
@pytest.mark.parametrize("mode", ["numpy", "jax", "jit"])
def test_anchor_grid_matches_the_spec_loop(seq_len: int, stride: int, block_size: int, mode: str):
    batch = random_batch(seq_len, stride, batch=8, seed=seq_len + stride + block_size)
    anchors = AnchorGrid(seq_len, stride, block_size).anchors
    if mode == "numpy":
        got = grid_outputs(batch, anchors, block_size)
    elif mode == "jax":
        got = grid_outputs({k: jnp.asarray(v) for k, v in batch.items()}, anchors, block_size)
    else:
        got = jax.jit(functools.partial(grid_outputs, anchors=anchors, block_size=block_size))(batch)
    expected = reference(batch, stride, block_size)
    for key in ("valid", "slots", "ids", "positions"):
        np.testing.assert_array_equal(np.asarray(got[key]), expected[key], err_msg=key)
    assert got["valid"].dtype == jnp.bool_ and got["slots"].dtype == jnp.bool_
    assert got["ids"].dtype == jnp.int32
    assert float(got["utilisation"]) == pytest.approx(expected["valid"].mean())
    assert expected["valid"].any() and expected["slots"].any() and not expected["valid"].all()  # a real test


def test_anchor_grid_anchors_are_the_static_grid():
    anchors = AnchorGrid(16, 4, 2).anchors
    assert isinstance(anchors, np.ndarray) and anchors.dtype == np.int32
    assert anchors.tolist() == [0, 4, 8, 12]
    with pytest.raises(ValueError, match=r"seq_len \(18\) must be a multiple of AnchorGrid.stride \(4\)"):
        AnchorGrid(18, 4, 2)


@pytest.mark.parametrize("seq_len, stride, max_anchors, expected_stride", [
    (4096, 16, 512, 16),  # 256 anchors: under the cap, the stride as given
    (4096, 8, 512, 8),  # exactly 512
    (32768, 16, 512, 64),  # 2048 anchors -> 512
    (131072, 16, 512, 256),
    (33024, 16, 512, 96),  # 2064 anchors: 5 does not divide them, 6 does (344 anchors)
    (32768, 16, None, 16),  # no cap
])
def test_long_rows_widen_the_stride_to_the_anchor_cap(seq_len, stride, max_anchors, expected_stride):
    grid = AnchorGrid.for_rows(seq_len, stride, 16, max_anchors)
    assert grid.stride == expected_stride and seq_len % grid.stride == 0
    assert max_anchors is None or grid.num_anchors <= max_anchors
    # Spread over the whole row: the last anchor is within one stride of the row's end.
    assert grid.anchors[-1] == seq_len - grid.stride


def test_slots_stop_at_document_boundaries_and_the_row_end():
    # One row: [pad, doc 1 (4 tokens, all trained), doc 2 (3 tokens, first untrained)], T = 8, anchors 0 and 4.
    loss_mask = np.array([[0, 1, 1, 1, 1, 0, 1, 1]])
    segment_ids = np.array([[0, 1, 1, 1, 1, 2, 2, 2]])
    anchors = AnchorGrid(8, 2, 4).anchors  # 0, 2, 4, 6
    assert anchor_validity(loss_mask, anchors).tolist() == [[False, True, False, True]]
    slots = np.asarray(slot_mask(loss_mask, segment_ids, anchors, 4))
    assert slots[0, 1].tolist() == [False, True, True, False]  # a=2: slots 3, 4 in doc 1; 5 is doc 2
    assert slots[0, 3].tolist() == [False, True, False, False]  # a=6: slot 7 trained, 8 and 9 are past the row
