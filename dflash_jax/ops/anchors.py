"""The static anchor grid (design §4) and what it gives each batch of rows, in jax.numpy for the jitted step.

Anchors sit at a_j = j*S for j < N = T/S in every row; the loader's phase shift moves the content instead of
the grid, so everything indexed by anchors has static shapes. On long rows the stride widens so that a row keeps
at most `max_anchors` anchors, spread evenly over the whole row (`AnchorGrid.for_rows`). Slot k of block j sits
at position a_j + k and is flattened as index j*B + k in [batch, N*B] outputs. The per-row helpers take [batch, T]
arrays (NumPy or JAX) and the static NumPy `AnchorGrid.anchors`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def check_block_size(block_size: int, name: str) -> None:
    """The one limit on a block's size, wherever a size is given (the config, DrafterConfig, AnchorGrid): an
    anchor slot plus at least one drafted slot. ValueError naming `name`."""
    if block_size < 2:
        raise ValueError(f"{name} must be >= 2 (the anchor slot plus at least one drafted slot), got {block_size}")


@dataclasses.dataclass(frozen=True)
class AnchorGrid:
    """Static anchors a_j = j*stride, j < seq_len/stride, each heading a block of block_size slots."""

    seq_len: int
    stride: int
    block_size: int

    def __post_init__(self):
        for name in ("seq_len", "stride", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"AnchorGrid.{name} must be a positive int, got {value!r}")
        if self.seq_len % self.stride:
            raise ValueError(f"AnchorGrid.seq_len ({self.seq_len}) must be a multiple of "
                             f"AnchorGrid.stride ({self.stride})")
        check_block_size(self.block_size, "AnchorGrid.block_size")

    @classmethod
    def for_rows(cls, seq_len: int, anchor_stride: int, block_size: int, max_anchors: int | None) -> AnchorGrid:
        """The grid of rows of seq_len tokens: stride anchor_stride, widened to its smallest multiple that divides
        seq_len and leaves at most max_anchors anchors (None: no cap). A row of 32K tokens at stride 16 has 2048
        anchors; capped at 512 its stride is 64, and its anchors still reach the row's last 64 positions."""
        num_anchors = seq_len // anchor_stride
        if max_anchors is None or num_anchors <= max_anchors:
            return cls(seq_len, anchor_stride, block_size)
        widen = next(f for f in range(-(-num_anchors // max_anchors), num_anchors + 1) if num_anchors % f == 0)
        return cls(seq_len, anchor_stride * widen, block_size)

    @property
    def num_anchors(self) -> int:
        return self.seq_len // self.stride

    @property
    def num_queries(self) -> int:
        return self.num_anchors * self.block_size

    @property
    def anchors(self) -> np.ndarray:
        return np.arange(self.num_anchors, dtype=np.int32) * self.stride

    @property
    def query_anchors(self) -> np.ndarray:
        """[N*B]: the anchor a_j of every query row j*B + k."""
        return np.repeat(self.anchors, self.block_size)

    @property
    def query_slots(self) -> np.ndarray:
        """[N*B]: the slot k of every query row j*B + k."""
        return np.tile(np.arange(self.block_size, dtype=np.int32), self.num_anchors)


@struct.dataclass
class DrafterInputs:
    """Where the drafter's blocks sit in a batch of rows: the static grid, and per row the RoPE positions and
    documents of the context and of the blocks (design §3-§5)."""

    grid: AnchorGrid = struct.field(pytree_node=False)
    context_positions: jax.Array  # [b, T] the rows' positions (restarting in each packed document)
    block_positions: jax.Array  # [b, N*B] positions[a_j] + k
    context_segment_ids: jax.Array  # [b, T] the rows' document ids
    anchor_segment_ids: jax.Array  # [b, N] the document of each anchor

    @classmethod
    def from_rows(cls, grid: AnchorGrid, positions: jax.Array, segment_ids: jax.Array) -> DrafterInputs:
        positions, segment_ids = jnp.asarray(positions), jnp.asarray(segment_ids)
        return cls(grid, positions, block_positions(positions, grid.anchors, grid.block_size), segment_ids,
                   segment_ids[:, grid.anchors])


def _slot_indices(seq_len: int, anchors: np.ndarray, block_size: int) -> tuple[jax.Array, jax.Array]:
    """[N, B] row index a+k of every slot, clipped into the row, and whether it was in the row at all."""
    index = jnp.asarray(anchors)[:, None] + jnp.arange(block_size)[None, :]
    return jnp.minimum(index, seq_len - 1), index < seq_len


def anchor_validity(loss_mask: jax.Array | np.ndarray, anchors: np.ndarray) -> jax.Array:
    """[batch, N] bool: anchor a is valid iff loss_mask[a] == 1, loss_mask[a+1] == 1 and a+1 < T."""
    trained = jnp.asarray(loss_mask).astype(bool)
    anchors = jnp.asarray(anchors)
    next_index = anchors + 1
    next_in_row = next_index < trained.shape[1]
    next_trained = trained[:, jnp.minimum(next_index, trained.shape[1] - 1)]
    return trained[:, anchors] & next_trained & next_in_row[None, :]


def slot_mask(
    loss_mask: jax.Array | np.ndarray,
    segment_ids: jax.Array | np.ndarray,
    anchors: np.ndarray,
    block_size: int,
    from_anchor: bool = False,
) -> jax.Array:
    """[batch, N, B] bool: slot k, whose label sits at i = a+k (i = a+k+1 with `from_anchor`, DSpark's layout
    where every slot predicts the next token, design §18), is trained iff k >= 1 (any k with `from_anchor`),
    the anchor is valid, i < T, segment_ids[i] == segment_ids[a] and loss_mask[i] == 1."""
    trained = jnp.asarray(loss_mask).astype(bool)
    segment_ids = jnp.asarray(segment_ids)
    index, in_row = _slot_indices(trained.shape[1], np.asarray(anchors) + int(from_anchor), block_size)
    same_document = segment_ids[:, index] == segment_ids[:, jnp.asarray(anchors)][:, :, None]
    drafted_slot = jnp.arange(block_size) >= (0 if from_anchor else 1)
    valid = anchor_validity(trained, anchors)[:, :, None]
    return valid & in_row[None] & drafted_slot[None, None, :] & same_document & trained[:, index]


def slot_tokens(input_ids: jax.Array | np.ndarray, anchors: np.ndarray, block_size: int) -> jax.Array:
    """[batch, N, B]: input_ids[a+k] (clipped into the row), the data token at each block slot; DSpark's Markov
    head reads it as the token before slot k's label (design §18)."""
    index, _ = _slot_indices(jnp.asarray(input_ids).shape[1], anchors, block_size)
    return jnp.asarray(input_ids)[:, index]


def block_token_ids(
    input_ids: jax.Array | np.ndarray, anchors: np.ndarray, block_size: int, mask_token_id: int
) -> jax.Array:
    """[batch, N*B]: slot 0 holds input_ids[a], slots 1..B-1 hold mask_token_id."""
    input_ids = jnp.asarray(input_ids)
    anchor_ids = input_ids[:, jnp.asarray(anchors)][:, :, None]
    is_anchor_slot = (jnp.arange(block_size) == 0)[None, None, :]
    blocks = jnp.where(is_anchor_slot, anchor_ids, jnp.asarray(mask_token_id, input_ids.dtype))
    return blocks.reshape(input_ids.shape[0], -1)


def block_positions(positions: jax.Array | np.ndarray, anchors: np.ndarray, block_size: int) -> jax.Array:
    """[batch, N*B]: positions[a] + k, the RoPE position of each block slot."""
    positions = jnp.asarray(positions)
    offsets = jnp.arange(block_size, dtype=positions.dtype)[None, None, :]
    return (positions[:, jnp.asarray(anchors)][:, :, None] + offsets).reshape(positions.shape[0], -1)


def anchor_utilisation(valid: jax.Array | np.ndarray) -> jax.Array:
    """Fraction of anchors that are valid (valid / all): the price of the static grid."""
    return jnp.mean(jnp.asarray(valid).astype(jnp.float32))
