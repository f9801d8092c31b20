"""Throughput of data regeneration (`python -m dflash_jax.regenerate`) on the bundled toy target, CPU, fp32:
generated tokens per second at several batch sizes, through the command itself, optionally against another
version of the code side by side.

    .venv/bin/python -m bench.bench_regenerate [--batch-sizes 16,64] [--records 64] [--max-new-tokens 128]
        [--rounds 3] [--before CHECKOUT]

The prompts are the first --records prompts of dflash_jax/assets/toy_data/eval.jsonl (64-192 tokens), greedy, up
to --max-new-tokens each (a row stops at <|endoftext|>). Every run is the command in a fresh process on one CPU
device, into a fresh output file, with a scratch persistent compilation cache that a first untimed run per
version and batch size fills, so the timed runs load their programs instead of compiling them. --before runs a
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "dflash_jax" / "assets"
RATE = re.compile(r"(\d+) tokens at (\d+) tokens/s")


def run_once(checkout: Path, prompts: Path, out: Path, batch_size: int, max_new_tokens: int,
             cache: Path) -> tuple[int, float, float]:
    """(generated tokens, tokens/s, wall seconds) of one run of the command from `checkout`."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}  # one CPU device
    env.update(PYTHONPATH=str(checkout), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache))
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "dflash_jax.regenerate", "--config",
                          str(checkout / "configs" / "toy.py"), f"--prompts={prompts}", f"--out={out}",
                          f"--batch_size={batch_size}", f"--max_new_tokens={max_new_tokens}", "--quiet"],
                         cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    found = RATE.search(run.stderr)
    if run.returncode or not found:
        raise SystemExit(f"{checkout}: regenerate failed:\n{run.stderr[-3000:]}")
    return int(found.group(1)), float(found.group(2)), wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="a checkout of the version to compare with")
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
        for name, checkout in versions.items():  # fills each version's compilation cache
            for batch_size in batch_sizes:
                run_once(checkout, prompts, scratch / f"{name}-{batch_size}-warm.jsonl", batch_size,
                         args.max_new_tokens, scratch / f"cache-{name}")
        for round_index in range(args.rounds):
            for batch_size in batch_sizes:
                for name, checkout in versions.items():
                    out = scratch / f"{name}-{batch_size}-{round_index}.jsonl"
                    results[name, batch_size].append(run_once(checkout, prompts, out, batch_size,
                                                              args.max_new_tokens, scratch / f"cache-{name}"))
                    loads.append(os.getloadavg()[0])

    print(f"toy target, {len(lines)} prompts, greedy, up to {args.max_new_tokens} new tokens, {args.rounds} "
          f"alternating rounds; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one CPU "
          f"device; 1-minute load average {min(loads):.1f}-{max(loads):.1f} over the runs\n")
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
