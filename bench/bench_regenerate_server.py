"""Regeneration throughput on the bundled toy target, CPU, fp32, greedy: the JAX path (`regenerate --config`)
against a vLLM CPU server (`regenerate --server`), the same prompts and token limit, side by side in one run.

    env -u XLA_FLAGS .venv/bin/python -m bench.bench_regenerate_server --vllm-python .venv-vllm/bin/python \
        [--records 64] [--max-new-tokens 128] [--batch-size 16] [--concurrency 64]

(`make .venv-vllm/.installed` builds the vLLM venv.) The prompts are the first --records prompts of
dflash_jax/assets/toy_data/eval.jsonl (64-192 tokens). Each path runs its job twice into fresh output files, the
first untimed (JAX compiles; vLLM warms up), and reports the second: generated tokens over the job's generation
time (the JAX path's decoding time; the server path's time from the first request to the last answer) and the
job's wall time (the JAX path's target is loaded once, before both runs). The vLLM server runs with
--max-num-seqs equal to --concurrency and shares the host's cores with this process (the client is idle while
waiting). Prints a markdown table and the load average: figures taken on busy cores are floors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax.numpy as jnp  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from dflash_jax.commands import regenerate  # noqa: E402
from dflash_jax.eval.examples import stop_token_ids  # noqa: E402
from dflash_jax.regeneration.decode import BatchDecoder  # noqa: E402
from dflash_jax.regeneration.job import regenerate as jax_job  # noqa: E402
from dflash_jax.regeneration.output import ResumableJsonl  # noqa: E402
from dflash_jax.weights.targets import load_target  # noqa: E402
from tests.serving.vllm_server import TOY_TARGET, toy_target_server  # noqa: E402


def timed(job, scratch: Path, name: str) -> tuple[int, float, float]:
    """(generated tokens, tokens/s, wall s) of the second of two runs of job(out)."""
    for run in ("warm-up", "timed"):
        began = time.perf_counter()
        summary = job(scratch / f"{name}-{run}.jsonl")
        wall = time.perf_counter() - began
    return summary.generated_tokens, summary.tokens_per_second, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="the JAX path's batch size")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight on the vLLM server")
    args = parser.parse_args()

    lines = (REPO / "dflash_jax/assets/toy_data/eval.jsonl").read_text().splitlines()[:args.records]
    rows = []
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        prompts = scratch / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": json.loads(line)["prompt"]}) + "\n" for line in lines))
        # The JAX path's job code with one decoder for both runs (as bench_regenerate.py), so the timed run
        # reuses the warm-up's compilation.
        target, _ = load_target(TOY_TARGET, param_dtype=jnp.float32)
        tokenizer = AutoTokenizer.from_pretrained(TOY_TARGET)
        decoder = BatchDecoder(target, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                               stop_token_ids=stop_token_ids(TOY_TARGET, tokenizer))
        rows.append((f"JAX path, batch {args.batch_size}", *timed(
            lambda out: jax_job(decoder, tokenizer, [str(prompts)], ResumableJsonl(out, {}),
                                max_prompt_tokens=10**9, progress=False), scratch, "jax")))
        with toy_target_server(args.vllm_python, scratch / "vllm.log", max_num_seqs=args.concurrency) as url:
            rows.append((f"vLLM CPU server, {args.concurrency} in flight", *timed(
                lambda out: regenerate.run_server([url], [str(prompts)], str(out), max_new_tokens=args.max_new_tokens,
                                                  temperature=0.0, tokenizer=str(TOY_TARGET),
                                                  concurrency=args.concurrency, progress=False), scratch, "vllm")))

    print(f"toy target, {len(lines)} prompts, greedy fp32, up to {args.max_new_tokens} new tokens; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| path | generated tokens | tokens/s | wall s (job) |")
    print("|---|---:|---:|---:|")
    for name, tokens, rate, wall in rows:
        print(f"| {name} | {tokens} | {rate:,.0f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
