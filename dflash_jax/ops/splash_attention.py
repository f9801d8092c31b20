"""Attention on the TPU splash-attention kernel, skipping the mask's empty tiles: the drafter's DFlash attention
(design §5, `dflash_attention_splash`) and the targets' causal attention within segments (`causal_attention_splash`).

The static position part of the mask (ops/mask.py's rules) is a computable splash mask, `GridMask`: the
kernel evaluates the rule inside each tile rather than loading a stored [N*B, T + N*B] array, and reduces it
once to per-tile info (empty / partial / full) without ever holding the whole mask (at T = 32K with the 27B
grid that array would be 6 GiB, and the kernel's set-up hashes a stored mask's bytes once per head). It never
visits an empty (query-tile, key-tile) pair, forward or backward. The document part is the kernel's segment
ids: a query carries its anchor's segment, a context key its own, and a block key the segment of its block's
anchor, so a query always matches its own block (no row is ever fully masked, which the kernel requires).

Kernel constraints (jax 0.10 `splash_attention_kernel`, enforced in interpret mode too):
- key tiles (`block_kv`, `block_kv_compute`) must be multiples of 128 (TPU lanes), and with segment ids so
  must the query tiles of the backward dK/dV kernel; we use one query and one key tile, multiples of 128,
  for the forward and both backward kernels (`splash_tiles`);
- tiles must divide the lengths, so N*B queries and T + N*B keys are padded at the end up to a multiple of
  128 (see `GridMask`);
- any head_dim runs in the interpreter (8, 16, 200 tried); on TPU a multiple of 128 avoids padded lanes
  (Qwen3's 128);
- GQA is native: the kernel maps query head h to kv head h // (Hq / Hkv), as `grouped_attention` does, so
  k/v are never repeated;
- the kernel does not scale q; we scale it here;
- jit does not partition a Pallas kernel over a device mesh: given the mesh the inputs are sharded on, the
  kernel runs per shard (`_on_mesh`).

The targets' attention is the kernel's lazy causal mask (its tile info is computed, not read from a [T, T]
array) with the documents as segment ids; it is built without backward tiles, as the targets are frozen.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import Mesh, PartitionSpec

from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.ops.mask import block_rule, context_rule, tile_fraction, validate_window
from dflash_jax.sharding import row_split_axes

log = logging.getLogger(__name__)

LANES = 128  # the kernel's tile granularity
# Largest tile tried. Bigger tiles amortise the kernel's per-tile overhead but compute more masked entries
# (27B shape: 0.34 of the tiles at 512 vs 0.27 at 128, see `splash_tile_fraction`); 512 is the common splash
# choice, to be tuned on TPU.
MAX_TILE = 512


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _tile(length: int) -> int:
    """The largest multiple of 128 up to MAX_TILE that divides length rounded up to 128 (no extra padding)."""
    padded = _round_up(length, LANES)
    return max(t for t in range(LANES, MAX_TILE + 1, LANES) if padded % t == 0)


def splash_tiles(grid: AnchorGrid) -> tuple[int, int]:
    """(query tile, key tile) used for this grid: queries N*B, keys T + N*B."""
    return _tile(grid.num_queries), _tile(grid.seq_len + grid.num_queries)


def splash_tile_fraction(grid: AnchorGrid, window: int | None) -> float:
    """Share of (query-tile, key-tile) pairs the kernel computes (design §5 statistic), for start-up logging."""
    return tile_fraction(grid, window, *splash_tiles(grid))


def _padded_lengths(grid: AnchorGrid) -> tuple[int, int]:
    """(queries, keys) of the kernel: N*B and T + N*B rounded up to multiples of 128."""
    return _round_up(grid.num_queries, LANES), _round_up(grid.seq_len + grid.num_queries, LANES)


class GridMask(mask_lib._ComputableMask):  # the base of jax's own lazy masks (CausalMask, LocalMask)
    """The position part of design §5's mask on the kernel's padded lengths, computed from indices: query q is
    slot q % B of the block at anchor (q // B)·S; keys below T are context (`context_rule`), the next N*B block
    keys (`block_rule`), the rest padding, never visible. A padded query sees exactly the last block key (and
    carries that block's segment): the kernel needs every row to see a key, since a fully masked row's softmax
    would rest on the kernel's mask value (NaN with -inf, and NaN times the zero cotangent of the dropped row
    would still poison the key gradients). A padded row's output is dropped, so it sends zero gradient to its
    key. The rule takes NumPy indices when the kernel reduces the mask to tile info and jax values inside the
    kernel, so it uses operators only."""

    def __init__(self, grid: AnchorGrid, window: int | None):
        self.grid, self.window = grid, window
        queries, keys = grid.num_queries, grid.seq_len + grid.num_queries

        def visible(query, key):
            real = query < queries
            block_index = query // grid.block_size  # (no `%`: floor division is what the lazy splash masks use)
            context = (key < grid.seq_len) & context_rule(block_index * grid.stride,
                                                          query - block_index * grid.block_size, key, window)
            block = (key >= grid.seq_len) & (key < keys) & block_rule(query, key - grid.seq_len, grid.block_size,
                                                                      causal=window is not None)
            return (real & (context | block)) | (~real & (key == keys - 1))

        super().__init__(_padded_lengths(grid), visible)

    def __eq__(self, other: object):
        return isinstance(other, GridMask) and (self.grid, self.window) == (other.grid, other.window)

    def __hash__(self):
        return hash((GridMask, self.grid, self.window))


@functools.lru_cache(maxsize=64)
def _kernel(grid: AnchorGrid, window: int | None, num_heads: int, interpret: bool):
    """The splash kernel for one (grid, window, heads): built once, since turning the mask into tile info
    walks every tile in NumPy. Built eagerly (ensure_compile_time_eval) so that calls from different traces
    can share it without leaking tracers."""
    q_tile, kv_tile = splash_tiles(grid)
    block_sizes = kernel_lib.BlockSizes(
        block_q=q_tile, block_kv=kv_tile, block_kv_compute=kv_tile,
        block_q_dkv=q_tile, block_kv_dkv=kv_tile, block_kv_dkv_compute=kv_tile,
        block_q_dq=q_tile, block_kv_dq=kv_tile)
    head_mask = GridMask(grid, window)
    # The same mask object for every head: the kernel keeps one copy of the tile info for all heads.
    mask = mask_lib.MultiHeadMask([head_mask] * num_heads)
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mha(mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=1,
                                          interpret=interpret)


def _interpret(interpret: bool | None, mesh: Mesh | None) -> bool:
    """None -> the Pallas interpreter unless the devices are TPUs: the mesh's (which may be a deviceless TPU
    topology compiled from a CPU host), else the default backend's. Correct but slow, so it is logged."""
    if interpret is None:
        platform = jax.default_backend() if mesh is None or mesh.empty else mesh.devices.flat[0].platform
        interpret = platform != "tpu"
        if interpret:
            log.warning("splash attention on %s runs in the Pallas interpreter (slow); use attention_impl='xla' "
                        "off TPU", platform)
    return interpret


def _kernel_layout(x: jax.Array, length: int) -> jax.Array:
    """[b, len, heads, D] -> the kernel's per-example [heads, len, D], padded at the end to length."""
    return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, length - x.shape[1]), (0, 0)))


def dflash_attention_splash(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    context_segment_ids: jax.Array,
    anchor_segment_ids: jax.Array,
    grid: AnchorGrid,
    window: int | None,
    scale: float,
    *,
    mesh: Mesh | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Same contract as `dflash_attention` (shapes, GQA, fp32 softmax), on the splash kernel, which tiles by
    itself. mesh: the device mesh the inputs are sharded on (the kernel then runs per shard; None: one
    device). interpret: run the Pallas interpreter (None = unless the backend is TPU; slow, for tests).
    """
    validate_window(window)
    batch, queries = q.shape[0], grid.num_queries
    expected = {"q": (q, queries), "k_ctx": (k_ctx, grid.seq_len), "v_ctx": (v_ctx, grid.seq_len),
                "k_blk": (k_blk, queries), "v_blk": (v_blk, queries),
                "context_segment_ids": (context_segment_ids, grid.seq_len),
                "anchor_segment_ids": (anchor_segment_ids, grid.num_anchors)}
    for name, (array, length) in expected.items():
        if tuple(array.shape[:2]) != (batch, length):
            raise ValueError(f"dflash_attention_splash: {name} has shape {tuple(array.shape)}, expected leading "
                             f"dimensions {(batch, length)} for {grid}")
    interpret = _interpret(interpret, mesh)
    padded_queries, padded_keys = _padded_lengths(grid)
    q_scaled = _kernel_layout((q * scale).astype(q.dtype), padded_queries)
    keys = _kernel_layout(jnp.concatenate([k_ctx, k_blk], axis=1), padded_keys)
    values = _kernel_layout(jnp.concatenate([v_ctx, v_blk], axis=1), padded_keys)
    # Edge padding gives padded queries the last block's segment, matching the one key they see.
    query_segment = jnp.repeat(anchor_segment_ids.astype(jnp.int32), grid.block_size, axis=1)
    key_segment = jnp.concatenate([context_segment_ids.astype(jnp.int32), query_segment], axis=1)
    segment_ids = kernel_lib.SegmentIds(
        q=jnp.pad(query_segment, ((0, 0), (0, padded_queries - queries)), mode="edge"),
        kv=jnp.pad(key_segment, ((0, 0), (0, padded_keys - key_segment.shape[1])), mode="edge"))

    kernel = functools.partial(_kernel, grid, window, interpret=interpret)
    out = _on_mesh(functools.partial(_attend, kernel), mesh, batch, keys.shape[1])(q_scaled, keys, values,
                                                                                   segment_ids)
    return jnp.swapaxes(out[:, :, :queries], 1, 2).astype(q.dtype)


@functools.lru_cache(maxsize=16)
def _causal_kernel(length: int, num_heads: int, interpret: bool):
    """The forward-only splash kernel of a causal mask over `length` (a multiple of 128) positions. Without
    backward tiles it has no gradient, which the frozen targets never need."""
    tile = _tile(length)
    block_sizes = kernel_lib.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile)
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * num_heads)
    with jax.ensure_compile_time_eval():  # as in `_kernel`: shared by the traces of every target layer
        return kernel_lib.make_splash_mha(mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=1,
                                          interpret=interpret)


def causal_attention_splash(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float, *,
                            mesh: Mesh | None = None, interpret: bool | None = None) -> jax.Array:
    """Same contract as `causal_attention` (ops/attention.py: q [B, T, Hq, D], k, v [B, T, Hkv, D], segment_ids
    [B, T], GQA, fp32 softmax), forward only, on the splash kernel. mesh, interpret: as for
    `dflash_attention_splash`.

    T is padded at the end to a multiple of 128. Padded positions take the last segment (edge padding), so a
    padded query sees at least itself (the kernel needs every row to see a key); a padded key lies after every
    real query, so the causal mask already hides it from them.
    """
    interpret = _interpret(interpret, mesh)
    length = q.shape[1]
    padded = _round_up(length, LANES)
    segments = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded - length)), mode="edge")
    kernel = functools.partial(_causal_kernel, padded, interpret=interpret)
    out = _on_mesh(functools.partial(_attend, kernel), mesh, q.shape[0], k.shape[2])(
        _kernel_layout((q * scale).astype(q.dtype), padded), _kernel_layout(k, padded), _kernel_layout(v, padded),
        kernel_lib.SegmentIds(q=segments, kv=segments))
    return jnp.swapaxes(out[:, :, :length], 1, 2).astype(q.dtype)


def _attend(kernel, q, k, v, segment_ids) -> jax.Array:
    """`kernel(num_heads)` over a batch: [b, Hq, Lq, D] queries, [b, Hkv, Lk, D] keys/values (local shapes, so
    under `_on_mesh` the kernel is built for the shard's own heads)."""
    return jax.vmap(kernel(q.shape[1]))(q, k, v, segment_ids)


def _on_mesh(attend, mesh: Mesh | None, rows: int, num_kv_heads: int):
    """On a device mesh, run `attend` per shard: jit cannot partition a Pallas kernel (on a multi-chip TPU it
    refuses to compile one outside shard_map). The `rows` rows split over the batch axes when they divide
    evenly (else, e.g. evaluation's single row, every shard takes them all), heads over `tensor` when the kv
    heads divide evenly (else every tensor shard computes all heads). Without a mesh: unchanged."""
    if mesh is None or mesh.empty:
        return attend
    row_axes = row_split_axes(mesh, rows) or None
    tensor = mesh.shape.get("tensor", 1)
    head_axis = "tensor" if tensor > 1 and num_kv_heads % tensor == 0 else None
    heads, row_spec = PartitionSpec(row_axes, head_axis), PartitionSpec(row_axes)
    segments = kernel_lib.SegmentIds(q=row_spec, kv=row_spec)
    # check_vma=False: pallas_call has no replication rule.
    return jax.shard_map(attend, mesh=mesh, in_specs=(heads, heads, heads, segments), out_specs=heads,
                         check_vma=False)
