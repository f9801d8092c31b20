"""The same CPU work under two Python/JAX stacks side by side: `make test`'s (Python 3.11, the pinned JAX 0.10.2)
and `make test-py312`'s (Python 3.12, the newest JAX the registry serves), so that the faster one is known per
machine (README, "Tested versions").

Each round starts one fresh process per stack, in alternating order, and each process times: `make demo`'s
drafter step (configs/toy.py's shape, fp32, bench/peer_step.py's project side) and its whole step (the toy
target's forward inside), and a 2048³ matmul in fp32 and in bf16. The figures are the medians over rounds with
their spread; the CPU model and the load average are printed with them.

    make venv test-py312   # both venvs
    .venv/bin/python -m bench.bench_stacks [--rounds 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACKS = {"3.11 (pinned)": ROOT / ".venv" / "bin" / "python", "3.12 (newest)": ROOT / ".venv-py312" / "bin" / "python"}
FIGURES = ("drafter_step_s", "whole_step_s", "float32_matmul_gflops", "bfloat16_matmul_gflops")


def measure(steps: int) -> dict:
    """One process's figures (run in the stack being measured)."""
    import jax
    import jax.numpy as jnp

    from bench.peer_step import SHAPES, ProjectSide, matmul_rate, peer_inputs

    shape = SHAPES["toy"]
    side = ProjectSide(shape, peer_inputs(shape), query_chunk_blocks=16)
    side.drafter_steps(1)  # compiles
    side.whole_steps(1)
    return {"python": platform.python_version(), "jax": jax.__version__,
            "drafter_step_s": side.drafter_steps(steps).median()[0],
            "whole_step_s": side.whole_steps(steps).median()[0],
            **{f"{dtype}_matmul_gflops": matmul_rate(2048, getattr(jnp, dtype), steps)
               for dtype in ("float32", "bfloat16")}}


def run_stack(python: Path, steps: int) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}  # one CPU device
    result = subprocess.run([str(python), "-m", "bench.bench_stacks", "--child", str(steps)], cwd=ROOT, env=env,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="timed calls per figure in each process")
    parser.add_argument("--json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    missing = [str(python) for python in STACKS.values() if not python.exists()]
    if missing:
        sys.exit(f"missing venvs {missing}: run `make venv test-py312` first")
    load_before = os.getloadavg()
    rounds: dict[str, list[dict]] = {name: [] for name in STACKS}
    for index in range(args.rounds):
        order = list(STACKS) if index % 2 == 0 else list(STACKS)[::-1]
        for name in order:
            rounds[name].append(run_stack(STACKS[name], args.steps))
            print(f"round {index + 1}, {name}: " + ", ".join(f"{k} {rounds[name][-1][k]:.4g}" for k in FIGURES),
                  flush=True)
    summary = {"cpu": cpu_model(), "cores": os.cpu_count(), "rounds": args.rounds, "load_before": load_before,
               "load_after": os.getloadavg(), "stacks": {}}
    for name, results in rounds.items():
        summary["stacks"][name] = {"python": results[0]["python"], "jax": results[0]["jax"], **{
            figure: {"median": statistics.median(r[figure] for r in results),
                     "spread": [min(r[figure] for r in results), max(r[figure] for r in results)]}
            for figure in FIGURES}}
    print(f"\n{summary['cpu']}, {summary['cores']} cores; {args.rounds} alternating rounds; load average before "
          f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in summary['load_after'])}")
    print("| stack | drafter step | whole step | 2048³ fp32 matmul | 2048³ bf16 matmul |\n|---|---:|---:|---:|---:|")
    for name, figures in summary["stacks"].items():
        cells = [f"{figures[f]['median']:.3f} s ({figures[f]['spread'][0]:.3f}-{figures[f]['spread'][1]:.3f})"
                 for f in FIGURES[:2]]
        cells += [f"{figures[f]['median']:.0f} GFLOP/s ({figures[f]['spread'][0]:.0f}-{figures[f]['spread'][1]:.0f})"
                  for f in FIGURES[2:]]
        print(f"| Python {figures['python']}, jax {figures['jax']} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
