"""Throughput of data regeneration (`python -m dflash_jax.regenerate`) on the bundled toy target, CPU, fp32:
generated tokens per second at several batch sizes, through the command itself, optionally against another
version of the code side by side.

    .venv/bin/python -m bench.bench_regenerate [--batch-sizes 16,64] [--records 64] [--max-new-tokens 128]
        [--rounds 3] [--before CHECKOUT] [--stop-text .]

The prompts are the first --records prompts of dflash_jax/assets/toy_data/eval.jsonl (64-192 tokens), greedy, up
to --max-new-tokens each (a row stops at <|endoftext|>, which the toy target never writes that soon, so every
response runs to the limit). --stop-text T makes T's token a stop token too (a copy of the target whose
generation_config lists it), so responses end at varied lengths as real ones do: with ".", a tenth within 4
tokens, half by 68, a fifth at the limit of 128. Every run is the command in a fresh process on one CPU
device, into a fresh output file, with a scratch persistent compilation cache that a first untimed run per
version and batch size fills (every program, however quick to compile), so the timed runs load their programs
instead of compiling them: the figures are a long job's steady state. --before runs a
checkout of another version (e.g. `git worktree add /tmp/before main`) the same way, alternating with this one
in every round so that a change of the machine's load hits both. tokens/s is the command's own figure
(generated tokens over the decoding time: prefill and decode, tokenization and writing excluded); wall is the
process's. Prints the median and the range over the rounds, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "dflash_jax" / "assets"
RATE = re.compile(r"(\d+) tokens at (\d+) tokens/s")


def run_once(checkout: Path, target: Path, prompts: Path, out: Path, batch_size: int, max_new_tokens: int,
             cache: Path) -> tuple[int, float, float]:
    """(generated tokens, tokens/s, wall seconds) of one run of the command from `checkout`."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}  # one CPU device
    env.update(PYTHONPATH=str(checkout), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # every program, also those compiled in < 1 s
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "dflash_jax.regenerate", "--config",
                          str(checkout / "configs" / "toy.py"), f"--config.target_dir={target}",
                          f"--prompts={prompts}", f"--out={out}",
                          f"--batch_size={batch_size}", f"--max_new_tokens={max_new_tokens}", "--quiet"],
                         cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    found = RATE.search(run.stderr)
    if run.returncode or not found:
        raise SystemExit(f"{checkout}: regenerate failed:\n{run.stderr[-3000:]}")
    return int(found.group(1)), float(found.group(2)), wall


def with_stop_token(target: Path, text: str, copy: Path) -> Path:
    """A copy of the target whose generation_config also stops at `text` (one token)."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise SystemExit(f"--stop-text {text!r} is {len(ids)} tokens, not one")
    shutil.copytree(target, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], ids[0]]
    (copy / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return copy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="a checkout of the version to compare with")
    parser.add_argument("--stop-text", help="a text of one token that also ends a response")
    args = parser.parse_args()

    versions = {"this": REPO} | ({"before": args.before.resolve()} if args.before else {})
    lines = (ASSETS / "toy_data" / "eval.jsonl").read_text().splitlines()[:args.records]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = {(name, b): [] for name in versions for b in batch_sizes}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        prompts = scratch / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": json.loads(line)["prompt"]}) + "\n" for line in lines))
        target = ASSETS / "toy_target"
        if args.stop_text:
            target = with_stop_token(target, args.stop_text, scratch / "target")
        for name, checkout in versions.items():  # fills each version's compilation cache
            for batch_size in batch_sizes:
                run_once(checkout, target, prompts, scratch / f"{name}-{batch_size}-warm.jsonl", batch_size,
                         args.max_new_tokens, scratch / f"cache-{name}")
        for round_index in range(args.rounds):
            for batch_size in batch_sizes:
                for name, checkout in versions.items():
                    out = scratch / f"{name}-{batch_size}-{round_index}.jsonl"
                    results[name, batch_size].append(run_once(checkout, target, prompts, out, batch_size,
                                                              args.max_new_tokens, scratch / f"cache-{name}"))
                    loads.append(os.getloadavg()[0])

    stops = f" or {args.stop_text!r}" if args.stop_text else ""
    print(f"toy target, {len(lines)} prompts, greedy, up to {args.max_new_tokens} new tokens or <|endoftext|>{stops}, "
          f"{args.rounds} alternating rounds; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"one CPU device; 1-minute load average {min(loads):.1f}-{max(loads):.1f} over the runs\n")
    print("| version | batch size | generated tokens | tokens/s (decoding), median (range) | wall s, median (range) |")
    print("|---|---:|---:|---:|---:|")
    for (name, batch_size), runs in results.items():
        tokens = sorted({t for t, _, _ in runs})
        rates, walls = [r for _, r, _ in runs], [w for _, _, w in runs]
        print(f"| {name} | {batch_size} | {'/'.join(map(str, tokens))} | {statistics.median(rates):,.0f} "
              f"({min(rates):,.0f}-{max(rates):,.0f}) | {statistics.median(walls):.1f} "
              f"({min(walls):.1f}-{max(walls):.1f}) |")


if __name__ == "__main__":
    main()
