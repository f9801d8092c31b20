"""Throughput of data regeneration (`python -m dflash_jax.regenerate`) on the bundled toy target, CPU, fp32:
generated tokens per second at several batch sizes, through the same job code as the command.

    .venv/bin/python -m bench.bench_regenerate [--batch-sizes 1,4,16,64] [--records 64] [--max-new-tokens 128]

The prompts are the first --records prompts of dflash_jax/assets/toy_data/eval.jsonl (64-192 tokens), greedy, up
to --max-new-tokens each (a row stops at <|endoftext|>). Each batch size runs the job once untimed (compilation),
then timed into a fresh output file; tokens/s counts the generated tokens over the decoding time (the job's own
figure: prefill and decode, tokenization and writing excluded). Prints a markdown table and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from transformers import AutoTokenizer

from dflash_jax.eval.examples import stop_token_ids
from dflash_jax.weights.targets import load_target
from dflash_jax.regeneration.decode import BatchDecoder
from dflash_jax.regeneration.job import regenerate
from dflash_jax.regeneration.output import ResumableJsonl

ASSETS = Path(__file__).resolve().parents[1] / "dflash_jax" / "assets"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    target_dir = ASSETS / "toy_target"
    model, _ = load_target(target_dir, param_dtype=jnp.float32)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    decoder = BatchDecoder(model, max_new_tokens=args.max_new_tokens,
                           stop_token_ids=stop_token_ids(target_dir, tokenizer))
    lines = (ASSETS / "toy_data" / "eval.jsonl").read_text().splitlines()[:args.records]
    prompts = [json.dumps({"prompt": json.loads(line)["prompt"]}) for line in lines]

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        prompt_file = Path(scratch) / "prompts.jsonl"
        prompt_file.write_text("\n".join(prompts) + "\n")
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            for run in ("compile", "timed"):
                out = Path(scratch) / f"{batch_size}-{run}.jsonl"
                began = time.perf_counter()
                summary = regenerate(decoder, tokenizer, [str(prompt_file)], ResumableJsonl(out, {}),
                                     batch_size=batch_size, max_prompt_tokens=10**9, progress=False)
                wall = time.perf_counter() - began
            rows.append((batch_size, summary.generated_tokens, summary.tokens_per_second, wall))

    print(f"toy target, {len(prompts)} prompts, greedy, up to {args.max_new_tokens} new tokens; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {jax.devices()[0].platform} "
          f"x {jax.device_count()}; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| batch size | generated tokens | tokens/s (decoding) | wall s (job) |")
    print("|---:|---:|---:|---:|")
    for batch_size, tokens, rate, wall in rows:
        print(f"| {batch_size} | {tokens} | {rate:,.0f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
