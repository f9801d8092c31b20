"""Train vLLM speculators' DFlash, DSpark or DFlash2 drafter on exactly the rows, features, labels and anchors a dflash_jax
run saw.

Runs in `.venv-speculators` (speculators and torch pinned by bench/speculators/requirements.txt, plus this
project for its data pipeline and its target), called by bench/learning_parity.py after the project's own run:

    .venv-speculators/bin/python bench/speculators/train_reference.py --run RUN_DIR --out OUT_DIR \
        --save_steps 160,320,480

RUN_DIR is a finished `dflash-jax train` workdir: its config (the last start in config_history.jsonl) is the
recipe (optimizer, learning rates, schedule, clipping, data, loss terms, drafter shape and method) and its
drafter_config.json the drafter.
What comes from each side:

- this project: the packed rows (its BatchLoader, same seed, same order), the frozen target's forward (feature
  layers and final hidden states, fp32), the static anchor grid and which anchors and slots are trained, and
  the drafter's initial weights (the run's seed);
- speculators: the drafter (DFlashDraftModel, DSparkDraftModel with its Markov and confidence heads, or
  DFlash2DraftModel with its block convolutions and candidate selector; sdpa attention), its LM head and greedy
  labels (the target's lm_head over the target's final hidden states), its loss terms with position weights
  (eager implementation; DSpark's confidence BCE, DFlash2's selector CE), its optimizers
  (`build_optimizers`: AdamW, or torch.optim.Muon on the 2-D weights and AdamW on the rest), transformers'
  warmup + cosine schedule and its trainer's step order (backward, clip the global norm to 1.0, step every
  optimizer, step every scheduler).

Two things are set to the project's choices because speculators draws or hard-codes them: the anchors (its
`select_anchors` draws random ones; here it returns the project's grid) and AdamW's betas (speculators leaves
torch's default (0.9, 0.999); here they are config.optim.b1/b2). A step's rows are packed side by side into one
row, as speculators trains on one packed row; document ids keep them apart.

Writes OUT_DIR/losses.jsonl (step, loss) and OUT_DIR/step_<N>.safetensors (the drafter in the export layout,
fp32) at each save step.
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import jax
import numpy as np
import torch
from flax import nnx
from ml_collections import ConfigDict
from safetensors.torch import save_file
from speculators.losses import resolve_loss_config
from speculators.models.dflash import core as dflash_core
from speculators.models.dflash.core import DFlashDraftModel
from speculators.models.dflash2 import DFlash2DraftModel
from speculators.models.dspark.core import DSparkDraftModel
from speculators.train.optimizers import build_optimizers
from transformers import AutoTokenizer, Qwen3Config, get_cosine_schedule_with_warmup

from dflash_jax.data import BatchLoader
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.ops import anchors as grid_ops
from dflash_jax.ops.anchors import AnchorGrid
from dflash_jax.train.state import make_drafter
from dflash_jax.train.validate import dtype_of
from dflash_jax.runtime.workdir import CONFIG_HISTORY
from dflash_jax.weights.drafter_files import drafter_to_torch_layout
from dflash_jax.weights.targets import load_target


# The project's loss term names -> speculators'.
SPECULATORS_TERMS = {"ce": "ce", "kl": "kl_div", "rkl": "rkl", "jsd": "jsd", "tv": "tv"}


def speculators_drafter(config: ConfigDict, drafter: DrafterConfig, initial: dict[str, np.ndarray]) -> DFlashDraftModel:
    """speculators' drafter of the project drafter's method, with its shape and initial weights."""
    layers = Qwen3Config(
        vocab_size=drafter.vocab_size, hidden_size=drafter.hidden_size, intermediate_size=drafter.intermediate_size,
        num_hidden_layers=drafter.num_hidden_layers, num_attention_heads=drafter.num_attention_heads,
        num_key_value_heads=drafter.num_key_value_heads, head_dim=drafter.head_dim, rms_norm_eps=drafter.rms_norm_eps,
        max_position_embeddings=drafter.max_position_embeddings, layer_types=list(drafter.layer_types),
        # Qwen3Config drops sliding_window (every layer then full attention) unless use_sliding_window is set.
        sliding_window=drafter.sliding_window, use_sliding_window="sliding_attention" in drafter.layer_types,
        rope_parameters={"rope_type": "default", "rope_theta": drafter.rope_theta})
    model_class, extra = DFlashDraftModel, {}
    if drafter.method == "dspark":  # the vanilla Markov head and the confidence head on [h; W1[prev]]
        model_class, extra = DSparkDraftModel, dict(markov_rank=drafter.markov_rank, markov_head_type="vanilla",
                                                   enable_confidence_head=True, confidence_head_with_markov=True)
    elif drafter.method == "dflash2":  # the block convolutions of every layer and the candidate selector
        model_class, extra = DFlash2DraftModel, dict(
            conv_kernel_size=drafter.conv_kernel_size, conv_group_size=drafter.conv_group_size,
            selector_rank=drafter.selector_rank, selector_top_k=drafter.selector_top_k)
    model = model_class.from_training_args(
        verifier_config=layers, verifier_name_or_path=config.target_dir, draft_vocab_size=drafter.vocab_size,
        block_size=drafter.block_size, target_layer_ids=list(drafter.target_layer_ids),
        mask_token_id=drafter.mask_token_id, draft_attn_impl="sdpa", **extra)
    # The verifier hidden states given below are the project target's final-normed ones.
    model.verifier_norm = torch.nn.Identity()
    missing, unexpected = model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()}, strict=False)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or trained - set(initial) or set(initial) - trained:
        raise SystemExit(f"error: weight names differ: unexpected {unexpected}, "
                         f"missing {sorted(trained - set(initial))}")
    return model.float()


def optimizers_for(model: DFlashDraftModel, config: ConfigDict):
    optim = config.optim
    if optim.name == "adamw" and optim.weight_decay:
        raise SystemExit("error: speculators' AdamW decays the norm weights too, the project never does; "
                         "compare with optim.weight_decay = 0")
    args = types.SimpleNamespace(
        optimizer=optim.name, lr=optim.learning_rate, weight_decay=optim.weight_decay,
        muon_lr=optim.get("muon_learning_rate") or optim.learning_rate, muon_momentum=optim.get("muon_momentum"),
        muon_weight_decay=optim.get("muon_weight_decay"), muon_ns_steps=optim.get("muon_ns_steps"),
        muon_adjust_lr_fn="match_rms_adamw")
    optimizers = build_optimizers(model, args)
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.AdamW):
            for group in optimizer.param_groups:
                group["betas"] = (optim.b1, optim.b2)
        elif not optim.get("muon_nesterov", True):
            for group in optimizer.param_groups:
                group["nesterov"] = False
    warmup = int(round(optim.warmup_ratio * config.total_steps))
    schedulers = [get_cosine_schedule_with_warmup(o, warmup, config.total_steps) for o in optimizers]
    return optimizers, schedulers


def packed_inputs(batch: dict[str, np.ndarray], features: np.ndarray, hidden: np.ndarray, grid: AnchorGrid,
                  from_anchor: bool):
    """One packed row of the step's rows side by side, the project's trained anchors in it, and a loss mask that
    is the project's slot mask laid on the positions a+k, where speculators reads slot k's (DFlash's slot 0 is never
    trained on either side; `from_anchor`: DSpark's, where it is)."""
    rows, seq_len = batch["input_ids"].shape
    valid = np.asarray(grid_ops.anchor_validity(batch["loss_mask"], grid.anchors))  # [rows, N]
    slots = np.asarray(grid_ops.slot_mask(batch["loss_mask"], batch["segment_ids"], grid.anchors, grid.block_size,
                                          from_anchor=from_anchor))
    offsets = np.arange(rows)[:, None] * seq_len
    anchors = (offsets + grid.anchors[None, :])[valid]
    loss_mask = np.zeros(rows * seq_len, np.int64)
    index = anchors[:, None] + np.arange(grid.block_size)[None, :]
    loss_mask[index] = slots[valid]
    segments = batch["segment_ids"].astype(np.int64)
    documents = np.where(segments > 0, segments + offsets, -1)  # unique per row; padding in none

    def one_row(x):
        return torch.from_numpy(np.ascontiguousarray(x).reshape(1, rows * seq_len, *x.shape[2:]))

    inputs = dict(hidden_states=one_row(features), input_ids=one_row(batch["input_ids"].astype(np.int64)),
                  loss_mask=torch.from_numpy(loss_mask)[None], verifier_last_hidden_states=one_row(hidden),
                  document_ids=one_row(documents), position_ids=one_row(batch["positions"].astype(np.int64)))
    return inputs, torch.from_numpy(anchors.astype(np.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="the project's finished training workdir (its recipe)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--save_steps", default="", help="comma-separated steps to save the drafter at")
    args = parser.parse_args()
    run, out = Path(args.run), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    starts = (run / CONFIG_HISTORY).read_text().splitlines()
    config = ConfigDict(json.loads(starts[-1])["config"])  # a single start: the parity run is never resumed
    drafter_config = DrafterConfig(**json.loads((run / "drafter_config.json").read_text()))
    save_steps = {int(s) for s in args.save_steps.split(",") if s}
    torch.manual_seed(config.seed)

    target, _ = load_target(config.target_dir, param_dtype=dtype_of(config.target_dtype), attention_impl="xla")
    target_graphdef, target_state = nnx.split(target)

    @jax.jit
    def target_forward(target_state, input_ids, positions, segment_ids):
        out = nnx.merge(target_graphdef, target_state)(input_ids, positions, segment_ids,
                                                       drafter_config.target_layer_ids)
        return out.features.reshape(*out.features.shape[:2], -1), out.hidden

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_dir or config.target_dir)
    data = config.data
    loader = BatchLoader(data.train_files, tokenizer, seq_len=data.seq_len, anchor_stride=data.anchor_stride,
                         batch_size=data.batch_size, seed=data.shuffle_seed, pad_id=tokenizer.pad_token_id or 0,
                         bad_records=data.bad_records, chat_template_kwargs=data.chat_template_kwargs)
    grid = AnchorGrid(data.seq_len, data.anchor_stride, drafter_config.block_size)
    if grid.stride < grid.block_size:
        raise SystemExit("error: blocks overlap (anchor_stride < block_size); the packed loss mask needs them apart")

    initial = drafter_to_torch_layout(make_drafter(drafter_config, config, "xla", seed=config.seed))
    model = speculators_drafter(config, drafter_config, initial)
    optimizers, schedulers = optimizers_for(model, config)
    terms = config.loss.get("terms") or {"ce": 1.0}
    loss_config = resolve_loss_config(json.dumps({SPECULATORS_TERMS[t]: w for t, w in terms.items()}), "eager")
    dspark = drafter_config.method == "dspark"
    # Each method's own loss part: DSpark's confidence BCE (against the detached 1 - TV), DFlash2's selector CE.
    tv_loss_fn = resolve_loss_config("tv", "eager")["tv"][0]
    method_kwargs = {"dflash": {},
                     "dspark": {"confidence_head_alpha": config.drafter.confidence_alpha, "tv_loss_fn": tv_loss_fn},
                     "dflash2": {"selector_loss_alpha": config.drafter.selector_alpha, "tv_loss_fn": tv_loss_fn},
                     }[drafter_config.method]
    # The run's position weights under speculators' names (a run from before D-PACE used the decay).
    position_weighting = ({"per_position_loss_weight": "dpace", "dpace_alpha": config.loss.dpace_alpha}
                          if config.loss.get("position_weights") == "dpace"
                          else {"per_position_loss_weight": "fixed-exp-decay"})
    chosen = {}
    dflash_core.select_anchors = lambda loss_mask, num_anchors, block_size: (  # the project's grid, all valid
        chosen["anchors"], torch.ones(num_anchors, dtype=torch.bool))

    with open(out / "losses.jsonl", "w") as log:
        for step in range(1, config.total_steps + 1):
            batch = next(loader)
            features, hidden = jax.device_get(target_forward(target_state, batch["input_ids"], batch["positions"],
                                                             batch["segment_ids"]))
            inputs, chosen["anchors"] = packed_inputs(batch, features, hidden, grid, from_anchor=dspark)
            for optimizer in optimizers:
                optimizer.zero_grad()
            _, loss, _ = model(**inputs, loss_config=loss_config, gamma=config.loss.gamma,
                               max_anchors=len(chosen["anchors"]), **position_weighting, **method_kwargs)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.clip_grad_norm)
            for optimizer in optimizers:
                optimizer.step()
            for scheduler in schedulers:
                scheduler.step()
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            if step % 20 == 0:
                log.flush()
                print(f"speculators {config.optim.name} step {step}: loss {loss.item():.4f}", flush=True)
            if step in save_steps:
                weights = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
                save_file(weights, str(out / f"step_{step}.safetensors"))


if __name__ == "__main__":
    main()
