"""Learning parity with vLLM's speculators: the same recipe must learn the same in both trainers.

    make learning-parity        # = .venv/bin/python -m bench.learning_parity [--optimizers adamw,muon]
    make learning-parity POSITION_WEIGHTS=dpace    # both trainers with D-PACE
    make learning-parity METHOD=dspark    # DSpark drafters (design §18), with DSpark's default loss (forward KL)
    make learning-parity METHOD=dflash2   # DFlash2 drafters (design §18.4), with DFlash2's default loss (forward KL)

For each optimizer: train the demo's drafter (configs/toy.py, the optimizer's recipe below) with this project's
trainer, then speculators' drafter of the same method on exactly the same rows, features, labels, anchors,
initial weights and recipe (bench/speculators/train_reference.py, in `.venv-speculators`), and measure exact
greedy τ of both with this project's evaluator on the demo's 64 held-out prompts at a few step counts. Prints a
markdown table (bench/RESULTS.md, "Learning parity") and writes every figure to OUT/parity.json
(OUT/parity-dpace.json with `--position_weights dpace`, OUT/parity-<method>.json with `--method dspark` or
`dflash2`).

Each training of 480 steps takes about four minutes (project) and about as long (speculators) on 2 idle CPU
cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from configs import toy
from dflash_jax.eval.examples import read_examples, stop_token_ids, with_greedy_continuations
from dflash_jax.eval.exact_tau import evaluate_drafter
from dflash_jax.eval.generate import SpeculativeGenerator, generator_shapes
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.train.loop import train
from dflash_jax.train.checkpoint import restore_drafter
from dflash_jax.weights.drafter_files import DRAFTER_CONFIG_FILE, drafter_from_torch_layout
from dflash_jax.weights.targets import load_target

REPO = Path(__file__).resolve().parents[1]
REFERENCE_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
MAX_NEW_TOKENS = 128  # as `make demo` evaluates


def recipe(optimizer: str, steps: int, position_weights: str, method: str = "dflash"):
    """configs/toy.py with `optimizer`, `position_weights` and the drafter `method`; AdamW's weight decay stays 0
    (speculators would decay norm weights). DSpark and DFlash2 train on speculators' default loss for them, the
    forward KL to the target's distribution (`--loss-fn kl_div`), plus DSpark's confidence BCE or DFlash2's
    selector CE."""
    config = toy.get_config()
    config.optim.name = optimizer
    config.loss.position_weights = position_weights
    config.drafter.method = method
    if method in ("dspark", "dflash2"):
        config.loss.terms = {"kl": 1.0}
    config.optim.weight_decay = 0.0
    config.total_steps = steps
    config.log_every = 1  # every step's loss, to compare with the reference's
    config.eval_every = 0
    return config


def train_both(config, out: Path, eval_steps: list[int]) -> None:
    project, reference = out / "project", out / "speculators"
    config.checkpoint_every = min(eval_steps)
    config.keep_checkpoints = len(eval_steps) + 1
    if not (project / "checkpoints" / str(config.total_steps)).exists():
        train(config, project)
    if not (reference / f"step_{config.total_steps}.safetensors").exists():
        # This checkout's package first on the reference's path: its rows and target are this checkout's.
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
        subprocess.run([str(REFERENCE_PYTHON), str(REPO / "bench" / "speculators" / "train_reference.py"),
                        "--run", str(project), "--out", str(reference),
                        "--save_steps", ",".join(map(str, eval_steps))], check=True, env=env)


def losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def drafters(out: Path, step: int):
    """(project drafter, speculators drafter) after `step` updates."""
    project, _, _ = restore_drafter(out / "project", step)
    config = DrafterConfig(**json.loads((out / "project" / DRAFTER_CONFIG_FILE).read_text()))
    tensors = load_file(str(out / "speculators" / f"step_{step}.safetensors"))
    return project, drafter_from_torch_layout(tensors, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--eval_steps", default="160,320,480")
    parser.add_argument("--position_weights", default="decay", choices=("decay", "dpace"))
    parser.add_argument("--method", default="dflash", choices=("dflash", "dspark", "dflash2"))
    parser.add_argument("--out", default=str(REPO / "out" / "learning_parity"))
    args = parser.parse_args()
    if not REFERENCE_PYTHON.exists():
        sys.exit("error: .venv-speculators is missing; `make learning-parity` builds it")
    eval_steps = [int(s) for s in args.eval_steps.split(",")]
    out = Path(args.out)
    optimizers = args.optimizers.split(",")
    # Each weighting's and method's runs and figures under names of their own (DFlash with the decay keeps the
    # old names).
    suffix = "".join(f"-{value}" for value, default in ((args.method, "dflash"), (args.position_weights, "decay"))
                     if value != default)
    runs = {optimizer: out / f"{optimizer}{suffix}" for optimizer in optimizers}
    for optimizer in optimizers:
        train_both(recipe(optimizer, args.steps, args.position_weights, args.method), runs[optimizer], eval_steps)

    config = recipe(optimizers[0], args.steps, args.position_weights, args.method)
    target, _ = load_target(config.target_dir, attention_impl="xla", param_dtype=jnp.float32)
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    examples = read_examples(config.data.eval_files, tokenizer, config.eval_prompts, max_continuation=MAX_NEW_TOKENS)
    shapes = generator_shapes([len(e.prompt_ids) for e in examples], MAX_NEW_TOKENS, config.drafter.block_size)
    examples = with_greedy_continuations(SpeculativeGenerator(target, None, **shapes), examples, MAX_NEW_TOKENS,
                                         stop_token_ids(config.target_dir, tokenizer))

    results = {}
    for optimizer in optimizers:
        run = runs[optimizer]
        ours, theirs = losses(run / "project" / "metrics.jsonl"), losses(run / "speculators" / "losses.jsonl")
        figures = {"loss_step_1": [ours[1], theirs[1]],
                   "loss_last_20": [float(np.mean([ours[s] for s in range(args.steps - 19, args.steps + 1)])),
                                    float(np.mean([theirs[s] for s in range(args.steps - 19, args.steps + 1)]))]}
        for step in eval_steps:
            figures[f"tau_{step}"] = [evaluate_drafter(target, drafter, examples, budgets=(8,),
                                                       vocab_chunk=config.loss.vocab_chunk)["tau"]
                                      for drafter in drafters(run, step)]
            print(f"{optimizer} step {step}: exact τ {figures[f'tau_{step}'][0]:.3f} (dflash_jax) "
                  f"{figures[f'tau_{step}'][1]:.3f} (speculators)", flush=True)
        results[optimizer] = figures
    (out / f"parity{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{args.method}, {args.position_weights} position weights")
    print("\n| optimizer | trainer | loss, step 1 | mean loss, last 20 steps | "
          + " | ".join(f"exact τ, step {s}" for s in eval_steps) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(eval_steps))
    for optimizer, figures in results.items():
        for side, name in enumerate(("dflash_jax", "speculators 0.9.0")):
            print(f"| {optimizer} | {name} | {figures['loss_step_1'][side]:.6f} | "
                  f"{figures['loss_last_20'][side]:.4f} | "
                  + " | ".join(f"{figures[f'tau_{s}'][side]:.3f}" for s in eval_steps) + " |")


if __name__ == "__main__":
    main()
