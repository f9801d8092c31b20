"""DFlash2's parts of the drafter (design §18.4): the grouped dynamic two-tap convolution around each sublayer,
and the candidate selector after the LM head.

Convolution (one per sublayer, `BlockConvolution`): with x the sublayer's normed input, rows i of a block in
slot order and pos(i) the slot, a kernel projection of x gives per row and group g (channels c with c // group =
g) a dynamic part δ[i, side, t, g] of 2 sides (input, output) x K taps, added to the learned base kernel
base[side, t, c]; the sublayer then reads
    conv_in(x)[i, c] = Σ_{t < K, pos(i) ≥ t} (base[0, t, c] + δ[i, 0, t, g(c)]) · x[i − t, c]
and its output y becomes conv_out(y) with side 1 and the same δ (computed from x, not y). Taps never cross a
block (pos(i) ≥ t), so every block is convolved on its own, in training and when decoding one block alike. At
initialisation base[:, 0] = 1, the other taps and the projection 0: both are the identity, and a DFlash2
drafter's output equals the DFlash drafter's with the same backbone weights.

Selector (`CandidateSelector`): slot k's candidates are the top-K tokens c of its unary logits z_k (the frozen
LM head's); each gets the score
    s(c | a, h_k) = z_k[c] + ⟨A[a] ⊙ W_h h_k, Bc[c]⟩
with a the token before slot k (the anchor's for slot 1), h_k the drafter's final-normed hidden state, A and
Bc codebooks [V, r] over the target vocabulary and W_h [H → r]. Decoding walks the block from the anchor, each
slot taking its best-scoring candidate after the token the previous slot took (`greedy_walk`).

The formulas are those of vLLM's speculators 0.9.0 (`models/dflash2/model_definitions.py`) and vLLM 0.32's
`qwen3_dflash2.py`, re-derived here; so are the initialisations (codebooks and W_h N(0, 0.02²)).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.layers import INIT_STD, Linear, param

CONV_FIELDS = ("conv_kernel_size", "conv_group_size")
SELECTOR_FIELDS = ("selector_rank", "selector_top_k")


def config_errors(config) -> list[str]:
    """What is wrong with a DrafterConfig's DFlash2 fields (all positive for "dflash2", all 0 otherwise)."""
    fields = CONV_FIELDS + SELECTOR_FIELDS
    values = {name: getattr(config, name) for name in fields}
    if not config.drafter_method.has_block_convolution:
        set_ones = [f"{name}={value!r}" for name, value in values.items() if value != 0]
        return [f"{', '.join(set_ones)} must be 0 for method {config.method!r}"] if set_ones else []
    errors = [f"{name} must be a positive int for method {config.method!r}, got {value!r}"
              for name, value in values.items()
              if not isinstance(value, int) or isinstance(value, bool) or value < 1]
    if errors:
        return errors
    if config.hidden_size % config.conv_group_size:
        errors.append(f"conv_group_size ({config.conv_group_size}) must divide hidden_size ({config.hidden_size})")
    if config.conv_kernel_size > config.block_size:
        errors.append(f"conv_kernel_size ({config.conv_kernel_size}) must be at most block_size "
                      f"({config.block_size}): taps never cross a block")
    if config.selector_top_k > config.vocab_size:
        errors.append(f"selector_top_k ({config.selector_top_k}) must be at most vocab_size ({config.vocab_size})")
    return errors


def block_convolution(x: jax.Array, delta: jax.Array, base: jax.Array, block_size: int) -> jax.Array:
    """x [..., Q, H] (Q = blocks·block_size rows, each block's slots in order), delta [..., Q, K, G] and base
    [K, H] -> out[i, c] = Σ_{t < K, slot(i) ≥ t} (base[t, c] + delta[i, t, c // (H/G)]) · x[i − t, c]."""
    *lead, rows, hidden = x.shape
    taps, groups = delta.shape[-2:]
    # The hidden axis stays whole and minor, and each group's delta reaches its H/G channels through a 0/1 matmul
    # (exact at HIGHEST precision): a [groups, H/G] split, of x or in a repeat's intermediate, would put H/G
    # channels (16 in the recipes) on the minor axis, which TPU pads to 128 lanes, 8 times the memory of every
    # such array the backward keeps.
    blocks = x.reshape(*lead, rows // block_size, block_size, hidden).astype(jnp.float32)
    spread = np.repeat(np.eye(groups, dtype=np.float32), hidden // groups, axis=1)  # [G, H]: channel c's group
    delta = jnp.einsum("...g,gh->...h", delta.astype(jnp.float32), spread, precision=jax.lax.Precision.HIGHEST)
    delta = delta.reshape(*blocks.shape[:-1], taps, hidden)
    base = base.astype(jnp.float32)
    out = jnp.zeros_like(blocks)
    for tap in range(taps):  # tap t reads the slot t earlier in the same block; the first t slots have none
        earlier = jnp.pad(blocks[..., :block_size - tap, :], [(0, 0)] * (len(lead) + 1) + [(tap, 0), (0, 0)])
        out = out + (base[tap] + delta[..., tap, :]) * earlier
    return out.reshape(x.shape).astype(x.dtype)


class ZeroLinear(Linear):
    """A `Linear` whose kernel starts at 0 (so its convolution starts at the identity, drawing no random numbers:
    the backbone's initialisation is the same for every method)."""

    def __init__(self, in_features: int, out_features: int, *, axes: tuple[str, str], param_dtype=jnp.float32,
                 dtype=None):
        self.kernel = param(jnp.zeros((in_features, out_features), param_dtype), axes)
        self.dtype = dtype


class BlockConvolution(nnx.Module):
    """The input- and output-side convolutions of one sublayer: base_kernel [2, K, H] and the kernel projection
    [H -> 2·K·G] (its outputs ordered side, tap, group, as the export's `kernel_projection.weight` rows)."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int, *,
                 param_dtype=jnp.float32, dtype=None):
        self.block_size, self.kernel_size, self.groups = block_size, kernel_size, hidden_size // group_size
        identity = jnp.zeros((2, kernel_size, hidden_size), param_dtype).at[:, 0].set(1.0)
        self.base_kernel = param(identity, ("conv_side", "conv_taps", "embed"))
        self.kernel_projection = ZeroLinear(hidden_size, 2 * kernel_size * self.groups,
                                            axes=("embed", "conv_kernels"), param_dtype=param_dtype, dtype=dtype)

    def around(self, sublayer: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
        """conv_out(sublayer(conv_in(x))), both sides' dynamic kernels from x."""
        delta = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, self.groups)
        base = self.base_kernel[...]
        y = sublayer(block_convolution(x, delta[..., 0, :, :], base[0], self.block_size))
        return block_convolution(y, delta[..., 1, :, :], base[1], self.block_size)


def convolved(convolution: BlockConvolution | None, sublayer: Callable[[jax.Array], jax.Array],
              x: jax.Array) -> jax.Array:
    """The sublayer on x, wrapped in its DFlash2 convolution where the drafter has one."""
    return sublayer(x) if convolution is None else convolution.around(sublayer, x)


def training_candidates(logits: jax.Array, labels: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Training's candidates of rows of unary logits [..., V] with hard labels [...]: (ids [..., K] int32, the
    top-K tokens with the label in place of the K-th where it is not among them; whether it was [...]). Every
    row so has its label among its candidates (at the first match, else K − 1) for the K-way cross-entropy,
    without widening the candidate set decoding sees."""
    _, ids = jax.lax.top_k(logits, top_k)
    contains = jnp.any(ids == labels[..., None], axis=-1)
    ids = ids.at[..., -1].set(jnp.where(contains, ids[..., -1], labels))
    return ids.astype(jnp.int32), contains


class CandidateSelector(nnx.Module):
    """predecessor_codebook A [V, r], successor_codebook Bc [V, r], hidden_projection W_h [H -> r]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, dtype=None):
        self.top_k = top_k
        self.predecessor_codebook = param(
            jax.random.normal(rngs.params(), (vocab_size, rank), param_dtype) * INIT_STD, ("vocab", "selector_rank"))
        self.successor_codebook = param(
            jax.random.normal(rngs.params(), (vocab_size, rank), param_dtype) * INIT_STD, ("vocab", "selector_rank"))
        self.hidden_projection = Linear(hidden_size, rank, axes=("embed", "selector_rank"), rngs=rngs,
                                        param_dtype=param_dtype, dtype=dtype)

    def context(self, hidden: jax.Array, predecessor_ids: jax.Array) -> jax.Array:
        """hidden [..., H], predecessor_ids [...] -> A[a] ⊙ W_h h [..., r] (fp32)."""
        predecessors = jnp.take(self.predecessor_codebook[...], predecessor_ids, axis=0).astype(jnp.float32)
        return predecessors * self.hidden_projection(hidden).astype(jnp.float32)

    def transition(self, context: jax.Array, candidate_ids: jax.Array) -> jax.Array:
        """context [..., r], candidate_ids [..., K] -> ⟨context, Bc[c]⟩ [..., K] (fp32)."""
        successors = jnp.take(self.successor_codebook[...], candidate_ids, axis=0).astype(jnp.float32)
        return jnp.einsum("...r,...kr->...k", context, successors)

    def scores(self, hidden: jax.Array, predecessor_ids: jax.Array, candidate_ids: jax.Array,
               candidate_logits: jax.Array) -> jax.Array:
        """The candidates' scores [..., K]: their unary logits [..., K] plus the transition after the
        predecessor."""
        return candidate_logits.astype(jnp.float32) + self.transition(self.context(hidden, predecessor_ids),
                                                                      candidate_ids)

    def best(self, hidden: jax.Array, predecessor_ids: jax.Array, candidate_ids: jax.Array,
             candidate_logits: jax.Array) -> jax.Array:
        """The best-scoring candidate's token [...] int32 (`scores`' arguments). The unary part may be shifted by
        a constant per row (log-probs for logits): the pick is the same."""
        best = jnp.argmax(self.scores(hidden, predecessor_ids, candidate_ids, candidate_logits), axis=-1)
        return jnp.take_along_axis(candidate_ids, best[..., None], axis=-1)[..., 0].astype(jnp.int32)

    def greedy_walk(self, hidden: jax.Array, unary_log_probs: jax.Array, anchor_ids: jax.Array) -> jax.Array:
        """Greedy decoding of one block per row: hidden [b, D, H] and unary log-probs [b, D, V] of the drafted
        slots, anchor_ids [b] -> drafts [b, D] int32, slot k the best of its top-K candidates after the token
        slot k − 1 took (the anchor's for the first), as vLLM's DFlash2 speculator walks at temperature 0."""
        candidate_log_probs, candidate_ids = jax.lax.top_k(unary_log_probs, self.top_k)  # every slot's at once

        def step(previous, slot):
            hidden_k, ids_k, log_probs_k = slot
            token = self.best(hidden_k, previous, ids_k, log_probs_k)
            return token, token

        slots = tuple(jnp.swapaxes(x, 0, 1) for x in (hidden, candidate_ids, candidate_log_probs))
        _, drafts = jax.lax.scan(step, anchor_ids.astype(jnp.int32), slots)
        return jnp.swapaxes(drafts, 0, 1)
