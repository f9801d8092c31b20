"""Throughput of exact-τ scoring (`evaluate`'s τ, histograms and DDTree τ; design §9.5) before and after texts
were batched, side by side on this machine's CPU cores, fp32.

    XLA_FLAGS=--xla_force_host_platform_device_count=N .venv/bin/python -m bench.bench_evaluate \
        [--shapes toy,qwen3_8b] [--rounds 3] [--rows N] [--before 262705e]

"before" is `dflash_jax/eval/exact_tau.py` as it stood at --before (read from git history: one text per jitted
forward, that row replicated over the mesh); "after" is this checkout's (--rows texts per forward, default the
scorer's, rows split over the mesh's data x fsdp axes). Both run `evaluate_drafter` (budgets 8 and 22, the host's
walks and DDTree trees included) on the same examples, with the target's weights split over a mesh of every
device (fsdp), after an untimed call that compiles them and checks that both give the same figures; rounds
alternate the two (the order flips every round) and report the median prompts/s and the range, so machine load
hits both alike. The load average is printed before and after.

Shapes: `toy`, the bundled toy target with an untrained drafter of configs/toy.py on the first --toy-prompts
records of its eval data (their own continuations, up to 256 tokens); `qwen3_8b`, a random target and drafter
with Qwen3-8B's layer shapes (hidden 4096, 32/8 heads of 128, MLP 12288, vocabulary 151936, block 16, tied
embeddings as bench/peer_step.py's qwen3_8b) but only two target layers (both fed to the drafter) and one drafter
layer, on --qwen-prompts random texts of 16 + 16 tokens (the full model does not fit this machine's memory).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from configs import toy
from dflash_jax.eval import exact_tau
from dflash_jax.eval.examples import read_examples
from dflash_jax.commands.evaluate import placed
from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.sharding import make_mesh, replicated, state_shardings
from dflash_jax.train.validate import resolve_drafter_config
from dflash_jax.weights.targets import load_target

BUDGETS = (8, 22)


def module_at(revision: str) -> types.ModuleType:
    """dflash_jax/eval/exact_tau.py as it stood at `revision`, imported under another name."""
    source = subprocess.run(["git", "show", f"{revision}:dflash_jax/eval/exact_tau.py"], check=True,
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    module = sys.modules[f"exact_tau_{revision}"] = types.ModuleType(f"exact_tau_{revision}")  # for its dataclasses
    exec(compile(source, f"exact_tau.py@{revision}", "exec"), module.__dict__)
    return module


def on_mesh(target, drafter, mesh):
    """Both models' weights placed as evaluate places them: the target's by the rule table, the drafter whole."""
    state = nnx.state(target)
    target = nnx.merge(nnx.graphdef(target), jax.device_put(state, state_shardings(state, mesh)))
    return target, placed(drafter, drafter.config, jnp.float32, replicated(mesh))


def toy_pair(prompts: int):
    config = toy.get_config()
    target, target_config = load_target(config.target_dir, param_dtype=jnp.float32)
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    drafter_config = resolve_drafter_config(config, target_config, tokenizer)
    examples = read_examples(config.data.eval_files, tokenizer, prompts, max_continuation=256)
    return target, Drafter(drafter_config, rngs=nnx.Rngs(0)), examples


def qwen3_8b_pair(prompts: int):
    target = Qwen3(Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                               tie_word_embeddings=True), rngs=nnx.Rngs(0))
    drafter = Drafter(DrafterConfig(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, layer_types=("full_attention",), block_size=16,
        target_layer_ids=(0, 1), num_target_layers=2, mask_token_id=151669, vocab_size=151936,
        max_position_embeddings=40960), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    examples = [exact_tau.Example(*rng.integers(0, 151936, (2, 16), dtype=np.int32)) for _ in range(prompts)]
    return target, drafter, examples


def measure(name: str, target, drafter, examples, rounds: int, rows: int, before: types.ModuleType) -> dict:
    variants = {"before": lambda: before.evaluate_drafter(target, drafter, examples, budgets=BUDGETS),
                "after": lambda: exact_tau.evaluate_drafter(target, drafter, examples, budgets=BUDGETS, rows=rows)}
    results = {variant: run() for variant, run in variants.items()}  # compiles, untimed
    assert results["before"] == results["after"], results
    rates = {variant: [] for variant in variants}
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(variants)[::-1]
        for variant in order:
            began = time.perf_counter()
            variants[variant]()
            rates[variant].append(len(examples) / (time.perf_counter() - began))
        print(f"{name} round {round_index + 1}: " + ", ".join(f"{v} {rates[v][-1]:.3f} prompts/s" for v in variants),
              flush=True)
    return {variant: (float(np.median(r)), min(r), max(r)) for variant, r in rates.items()}


def loads(averages) -> str:
    return ", ".join(f"{x:.1f}" for x in averages)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="toy,qwen3_8b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=None,
                        help="texts per forward after (default: the scorer's, one per device on CPU)")
    parser.add_argument("--before", default="262705e", help="the last commit that scored one text per forward")
    parser.add_argument("--toy-prompts", type=int, default=16)
    parser.add_argument("--qwen-prompts", type=int, default=4)
    args = parser.parse_args()
    before = module_at(args.before)
    mesh = make_mesh(devices=jax.devices())
    pairs = {"toy": lambda: toy_pair(args.toy_prompts), "qwen3_8b": lambda: qwen3_8b_pair(args.qwen_prompts)}
    load_before = os.getloadavg()
    table = []
    for name in args.shapes.split(","):
        target, drafter, examples = pairs[name]()
        target, drafter = on_mesh(target, drafter, mesh)
        lengths = [len(e.prompt_ids) + len(e.continuation_ids) for e in examples]
        rates = measure(name, target, drafter, examples, args.rounds, args.rows, before)
        table.append((name, len(examples), min(lengths), max(lengths), rates))
        del target, drafter
    print(f"\n{os.cpu_count()} CPUs, mesh of {jax.device_count()} {jax.devices()[0].platform} devices, {args.rounds} "
          f"rounds, after = {args.rows or 'default'} rows per forward; load average before {loads(load_before)}, "
          f"after {loads(os.getloadavg())}\n")
    print("| shape | devices | prompts | tokens a text | before, prompts/s | after, prompts/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, count, shortest, longest, rates in table:
        cells = [f"{median:.3f} ({low:.3f}-{high:.3f})" for median, low, high in (rates["before"], rates["after"])]
        print(f"| {name} | {jax.device_count()} | {count} | {shortest}-{longest} | {cells[0]} | {cells[1]} | "
              f"{rates['after'][0] / rates['before'][0]:.2f}x |")


if __name__ == "__main__":
    main()
