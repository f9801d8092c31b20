"""The jitted train step: frozen target forward, labels, drafter forward/backward, AdamW (design §4-§7).

One step = one optimizer update over `batch_size` packed rows, optionally as `grad_accum_steps`
micro-batches whose gradients are summed in a scan (the loss is normalised by the whole batch's trained-slot
count, so accumulation gives exactly the full-batch gradient). Per micro-batch:

1. `teacher`: the frozen target runs on the rows (no gradient; its attention on the backend it was loaded
   with, config.attention_impl in train/startup.py) and yields the drafter's `TargetContext`: the feature
   layers, the labels of the drafted slots k >= 1, the block embeddings and the LM head (the pair forward,
   models/dflash.py).
2. `drafter_loss`: optional uniform noise on the raw features (never on the labels' path), the drafter
   forward, the borrowed (frozen) LM head + cross-entropy in row chunks with the gradient fused into its
   forward (train/loss.py), the slot mask and position weights (the fixed decay, or D-PACE's from the
   detached CE of the same pass).

For method "dspark" (design §18) every block slot is drafted (slot k predicts the token after a+k), the Markov
bias W2·W1[input_ids[a+k]] is added to each slot's logits inside the fused loss's row chunks, and the confidence
head's BCE against the detached 1 − TV of the same pass is added with weight config.drafter.confidence_alpha.
For "dflash2" (design §18.4) the fused pass also yields each slot's top-K candidates, and the selector's K-way
cross-entropy (train/selector.py), weighted as the unary loss, is added with weight config.drafter.selector_alpha;
the slots' accuracy is then the selector's, whose picks decoding commits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from dflash_jax.models.dflash import TargetContext, target_context
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.ops.anchors import (DrafterInputs, anchor_utilisation, anchor_validity, slot_mask,
                                    slot_tokens)
from dflash_jax.sharding import (BATCH_AXES, CONTEXT_AXIS, SHARD_ROWS_EMBED, TARGET_LAYOUTS, batch_sharding,
                                 constrain, layout_rules, replicated, token_sharding)
from dflash_jax.train.confidence import confidence_loss
from dflash_jax.train.config import anchor_grid
from dflash_jax.train.loss import (dflash_loss, dpace_weights, lm_head_cross_entropy, position_weights,
                                   trained_slot_count)
from dflash_jax.train.divergences import lm_head_divergences
from dflash_jax.train.optimizer import learning_rate_schedule, make_optimizer
from dflash_jax.train.selector import selector_cross_entropy
from dflash_jax.train.state import StateSpec, TrainState
from dflash_jax.train.validate import parse_loss_terms

BATCH_KEYS = ("input_ids", "positions", "segment_ids", "loss_mask")


class LossAux(NamedTuple):
    labels: jax.Array  # [b, N, D] (drafted slots: D = B-1, or B for dspark)
    slot_correct: jax.Array  # [B]
    slot_count: jax.Array  # [B]
    confidence_loss: jax.Array  # scalar, already in the loss with its weight (0 without a confidence head)
    selector_loss: jax.Array  # scalar, already in the loss with its weight (0 without a candidate selector)


class MicroStepTotals(NamedTuple):
    """One micro-batch's gradients and metrics; summed over the micro-batches of a step (a pytree)."""
    grads: nnx.State
    loss: jax.Array  # scalar
    slot_correct: jax.Array  # [B]
    slot_count: jax.Array  # [B]
    confidence_loss: jax.Array  # scalar
    selector_loss: jax.Array  # scalar


class StepFunctions(NamedTuple):
    teacher: Callable  # (target_state, batch) -> TargetContext
    drafter_loss: Callable  # (params, teacher, batch, noise_key, normaliser) -> (loss, LossAux)
    # jitted (TrainState, target_state, batch, total_steps) -> (TrainState, metrics); total_steps, the learning-rate
    # schedule's length (an int32 scalar), is an argument so that the program is the same for any length
    train_step: Callable


def make_step(config: ConfigDict, drafter_config: DrafterConfig, spec: StateSpec, target_graphdef: nnx.GraphDef,
              target_shardings: nnx.State, mesh: Mesh) -> StepFunctions:
    if config.target_layout not in TARGET_LAYOUTS:
        raise ValueError(f"config.target_layout {config.target_layout!r} must be settled to one of "
                         f"{list(TARGET_LAYOUTS)} before the step is made (plan.py settles 'auto')")
    grid = anchor_grid(config)
    anchors, block = grid.anchors, grid.block_size
    method = drafter_config.drafter_method  # design §18
    from_anchor = method.drafts_anchor_slot  # every slot drafted, slot 0 included
    weights = jnp.asarray(position_weights(block, config.loss.gamma, from_anchor=from_anchor))
    dpace = config.loss.position_weights == "dpace"  # weights from the drafter's own confidence (design §6)
    terms = parse_loss_terms(config.loss.terms)
    confidence_alpha = config.drafter.confidence_alpha if method.has_markov_head else 0.0
    top_k = drafter_config.selector_top_k  # DFlash2's candidates per slot; 0: no selector (design §18.4)
    selector_alpha = config.drafter.selector_alpha if top_k else 0.0
    # The fused loss against the target's distribution (design §18), also for the confidence target 1 − TV.
    distribution = terms != (("ce", 1.0),) or confidence_alpha > 0

    # The drafted slots of a row as the loss walks them in chunks: [b, R]; on a row split over context, whose
    # drafter attends by anchor on each shard (design §19), [b, C, R/C], each shard's slots its own, so that a
    # chunk never reaches into another shard's (slicing the split axis gathered every shard's slots).
    context = mesh.shape.get(CONTEXT_AXIS, 1)
    shards = context if context > 1 and grid.num_anchors % context == 0 else 1

    def slot_rows(rows: int) -> tuple[int, ...]:
        return (rows, -1) if shards == 1 else (rows, shards, -1)

    def trained_slots(batch: dict[str, jax.Array]) -> jax.Array:
        return slot_mask(batch["loss_mask"], batch["segment_ids"], anchors, block, from_anchor=from_anchor)

    def teacher(target_state: nnx.State, batch: dict[str, jax.Array]) -> TargetContext:
        # Traced under the rules of the target's layout, which decide its embedding lookup (models/layers.py).
        with nnx.logical_axis_rules(layout_rules(config.target_layout)):
            return target_context(nnx.merge(target_graphdef, target_state), batch["input_ids"], batch["positions"],
                                  batch["segment_ids"], grid, drafter_config, labels=config.loss.labels,
                                  vocab_chunk=config.loss.vocab_chunk, with_distribution=distribution)

    def drafter_loss(params: nnx.State, teacher: TargetContext, batch: dict[str, jax.Array], noise_key: jax.Array,
                     normaliser: jax.Array) -> tuple[jax.Array, LossAux]:
        drafter = nnx.merge(spec.graphdef, params)
        features = teacher.features
        if config.loss.noise_std > 0:  # U(-std, std) on the raw features fed to fc; the labels are already fixed
            features = features + jax.random.uniform(noise_key, features.shape, features.dtype,
                                                     -config.loss.noise_std, config.loss.noise_std)
        hidden, _ = drafter(features, teacher.block_embeds,
                            DrafterInputs.from_rows(grid, batch["positions"], batch["segment_ids"]))
        rows = hidden.shape[0]
        drafted = hidden.reshape(rows, grid.num_anchors, block, -1)
        if not from_anchor:
            drafted = drafted[:, :, 1:]  # DFlash's slot 0 is never trained
        drafted = drafted.reshape(*slot_rows(rows), drafted.shape[-1])
        if shards > 1:
            drafted = constrain(drafted, SHARD_ROWS_EMBED)
        markov = None
        if method.has_markov_head:  # e_k = W1[x_{a+k}], the data token before slot k's label; bias added per row chunk
            prev_ids = slot_tokens(batch["input_ids"], anchors, block).reshape(slot_rows(rows))
            prev_embeddings = drafter.markov_head.prev_embeddings(prev_ids).astype(drafter.dtype)
            markov = (prev_embeddings, drafter.markov_head.w2[...].astype(drafter.dtype))
        if distribution:  # ce is then the weighted sum of the terms per slot
            ce, tv, correct, *candidates = lm_head_divergences(
                drafted, teacher.label_hidden.reshape(drafted.shape), teacher.lm_head,
                teacher.labels.reshape(slot_rows(rows)), terms, config.loss.row_chunk, markov, top_k)
        else:
            ce, correct, *candidates = lm_head_cross_entropy(drafted, teacher.lm_head,
                                                             teacher.labels.reshape(slot_rows(rows)),
                                                             config.loss.row_chunk, markov, top_k)
        mask = trained_slots(batch)

        def slot_loss(ce, correct):  # per-slot values of the drafted slots -> the weighted loss over [b, N, B]
            ce, correct = ce.reshape(teacher.labels.shape), correct.reshape(teacher.labels.shape)
            if not from_anchor:
                anchor_slot = ((0, 0), (0, 0), (1, 0))  # slot 0: ce 0, not correct (its mask is 0)
                ce, correct = jnp.pad(ce, anchor_slot), jnp.pad(correct, anchor_slot)
            slot_weights = dpace_weights(ce, mask, config.loss.dpace_alpha) if dpace else weights
            return dflash_loss(ce, correct, mask, slot_weights, normaliser)

        out = slot_loss(ce, correct)
        loss, confidence, selector = out.loss, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
        if top_k:  # DFlash2: the selector after x_{a+k-1}, the data's token before slot k's label
            predecessors = slot_tokens(batch["input_ids"], anchors, block)[:, :, :-1].reshape(slot_rows(rows))
            selected = slot_loss(*selector_cross_entropy(drafter.candidate_selector, drafted, teacher.lm_head,
                                                         candidates, predecessors,
                                                         teacher.labels.reshape(slot_rows(rows)),
                                                         config.loss.row_chunk))
            loss, selector = loss + selector_alpha * selected.loss, selected.loss
            out = out._replace(slot_correct=selected.slot_correct)
        if confidence_alpha > 0:  # always with the fixed decay, also under D-PACE (speculators)
            logits = drafter.confidence_head(drafted, prev_embeddings).reshape(mask.shape)
            confidence = confidence_loss(logits, tv.reshape(mask.shape), mask, weights, normaliser)
            loss = loss + confidence_alpha * confidence
        return loss, LossAux(teacher.labels, out.slot_correct, out.slot_count, confidence, selector)

    accum = config.grad_accum_steps
    micro_sharding = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES, None))

    def train_step(state: TrainState, target_state: nnx.State, batch: dict[str, jax.Array], total_steps: jax.Array
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
        # The activations' sharding constraints (dflash_jax.sharding.constrain) read the mesh from the trace
        # context.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return sharded_step(state, target_state, batch, total_steps)

    def sharded_step(state: TrainState, target_state: nnx.State, batch: dict[str, jax.Array], total_steps: jax.Array
                     ) -> tuple[TrainState, dict[str, jax.Array]]:
        normaliser = trained_slot_count(trained_slots(batch))
        rng, step_key = jax.random.split(jax.random.wrap_key_data(state.rng))

        def micro_step(micro_batch, noise_key):
            (loss, aux), grads = jax.value_and_grad(drafter_loss, has_aux=True)(
                state.params, teacher(target_state, micro_batch), micro_batch, noise_key, normaliser)
            # Laid out as the parameters are, so that the partial sums over the devices' rows are reduce-scattered
            # to each device's shard rather than all-reduced whole (design §13).
            grads = jax.lax.with_sharding_constraint(grads, spec.shardings.params)
            return MicroStepTotals(grads, loss, aux.slot_correct, aux.slot_count, aux.confidence_loss,
                                   aux.selector_loss)

        if accum == 1:
            totals = micro_step(batch, step_key)
        else:
            def accumulate(totals, inputs):
                return jax.tree.map(jnp.add, totals, micro_step(*inputs)), None

            zeros = MicroStepTotals(jax.tree.map(jnp.zeros_like, state.params), jnp.zeros(()), jnp.zeros(block),
                                    jnp.zeros(block), jnp.zeros(()), jnp.zeros(()))
            # Row r goes to micro-batch r % accum: every micro-batch keeps an even share of each device's rows.
            micro_batches = {key: jax.lax.with_sharding_constraint(
                jnp.swapaxes(value.reshape(-1, accum, value.shape[-1]), 0, 1), micro_sharding)
                for key, value in batch.items()}
            totals, _ = jax.lax.scan(
                accumulate, zeros, (micro_batches, jax.random.split(step_key, accum)))
        updates, opt_state = make_optimizer(config, total_steps).update(totals.grads, state.opt_state, state.params)
        metrics = {
            "loss": totals.loss,
            "slot_correct": totals.slot_correct,
            "slot_count": totals.slot_count,
            "anchor_utilisation": anchor_utilisation(anchor_validity(batch["loss_mask"], anchors)),
            "grad_norm": optax.tree.norm(totals.grads),  # before clipping
            "learning_rate": learning_rate_schedule(config, total_steps)(state.step),
        }
        if confidence_alpha > 0:
            metrics["confidence_loss"] = totals.confidence_loss  # unweighted; `loss` holds it times confidence_alpha
        if top_k:
            metrics["selector_loss"] = totals.selector_loss  # unweighted; `loss` holds it times selector_alpha
        new_state = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state,
                               jax.random.key_data(rng))
        return new_state, metrics

    batch_shardings = {key: token_sharding(mesh) for key in BATCH_KEYS}
    jitted = jax.jit(train_step, in_shardings=(spec.shardings, target_shardings, batch_shardings, replicated(mesh)),
                     out_shardings=(spec.shardings, replicated(mesh)), donate_argnums=0)
    return StepFunctions(teacher, drafter_loss, jitted)


def schedule_length(total_steps: int, mesh: Mesh) -> jax.Array:
    """config.total_steps as the step's `total_steps` argument: an int32 scalar on every device of `mesh`."""
    return jax.device_put(np.int32(total_steps), replicated(mesh))


def abstract_schedule_length(mesh: Mesh) -> jax.ShapeDtypeStruct:
    """The step's `total_steps` argument as an ahead-of-time compile sees it."""
    return jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(mesh))


def process_rows(mesh: Mesh, batch_size: int) -> list[int]:
    """The rows of the global batch that this process's devices hold (with one process: all of them), in
    order: the rows its loader builds."""
    indices = batch_sharding(mesh).addressable_devices_indices_map((batch_size, 1))
    return sorted({row for index in indices.values() for row in range(batch_size)[index[0]]})


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh, rows: list[int] | None = None,
              batch_size: int | None = None) -> dict[str, jax.Array]:
    """Host arrays holding rows `rows` (this process's: `process_rows`) of a global batch of `batch_size`
    rows -> global device arrays split over the batch axes; each device gets its rows from these arrays.
    Default: the arrays hold the whole batch. Their tokens split over the context axis (design §19)."""
    if rows is None:
        batch_size = len(batch[BATCH_KEYS[0]])
        rows = list(range(batch_size))
    sharding = token_sharding(mesh)
    position = {row: i for i, row in enumerate(rows)}

    def rows_of(value: np.ndarray) -> jax.Array:
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            return value[[position[row] for row in range(batch_size)[index[0]]]][(slice(None), *index[1:])]

        return jax.make_array_from_callback((batch_size, *value.shape[1:]), sharding, shard)

    return {key: rows_of(batch[key]) for key in BATCH_KEYS}
