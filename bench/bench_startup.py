"""Time to the first step with config.mesh left at its defaults against the same run with the chosen mesh given
explicitly, and that run against the same without a memory budget (no plan), on 8 simulated CPU devices
(design §13.1): a planned start compiles its step once, so it should take no longer than an unplanned one.

The CPU devices are taken as H200s (the chip table's peaks, config.hbm_gib as their memory), so that a default
mesh is chosen as it is on accelerators: from the analytical predictions, then one compiled plan of the best.
Each round is a fresh process training a tiny target for one step (no compilation cache, so every compile is
paid): first a default-mesh run, whose log names the mesh and layout it chose, then the run given that mesh and
layout, then that run without config.hbm_gib (no plan: the loop compiles the step); rounds alternate, and the
figure is the median of each side with its spread.

    PYTHONPATH=. .venv/bin/python -m bench.bench_startup [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
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

CHOICE = re.compile(r"config\.mesh left at its defaults: (\w+) layout on data=(\d+),fsdp=(\d+),tensor=(\d+),"
                    r"context=(\d+),dcn_data=(\d+)")


def child(root: Path, workdir: Path, mesh: str | None, layout: str, budget: bool) -> None:
    """One run of one step in this process; prints its seconds as JSON."""
    import logging

    from dflash_jax.planning.chips import chip_named
    from dflash_jax.train import loop, startup
    from tests.train_fixtures import tiny_config

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
    startup.chip_of_kind = lambda kind: chip_named("H200")  # the CPU devices taken as H200s
    config = tiny_config(root / "qwen3", root / "train.jsonl", **{
        "data.batch_size": 8, "hbm_gib": 1.0 if budget else None, "target_layout": layout, "total_steps": 1,
        "eval_every": 0, "compilation_cache_dir": "off"})
    config.mesh.update(data=1, fsdp=-1, tensor=1, dcn_data=1, context=1)
    if mesh:
        config.mesh.update({key: int(value) for key, value in (part.split("=") for part in mesh.split(","))})
    start = time.perf_counter()
    loop.train(config, workdir)
    print(json.dumps({"seconds": time.perf_counter() - start}))


def run(root: Path, mesh: str | None, layout: str, budget: bool = True) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as workdir:
        args = [sys.executable, "-m", "bench.bench_startup", "--child", str(root), "--workdir", workdir,
                "--layout", layout] + (["--mesh", mesh] if mesh else []) + ([] if budget else ["--no_budget"])
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
        result = subprocess.run(args, capture_output=True, text=True, env=env)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds"], result.stderr


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--workdir")
    parser.add_argument("--mesh")
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--no_budget", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(Path(args.child), Path(args.workdir), args.mesh, args.layout, not args.no_budget)

    from tests.train_fixtures import make_target, write_corpus

    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        make_target(root / "qwen3")
        write_corpus(root / "train.jsonl")
        times: dict[str, list[float]] = {"default": [], "explicit": [], "unplanned": []}
        chosen = None
        for _ in range(args.rounds):
            seconds, log = run(root, None, "auto")
            times["default"].append(seconds)
            match = CHOICE.search(log)
            if match is None:
                raise SystemExit("the default-mesh run logged no choice:\n" + log[-3000:])
            chosen = (match.group(1), f"data={match.group(2)},fsdp={match.group(3)},tensor={match.group(4)},"
                                      f"context={match.group(5)},dcn_data={match.group(6)}")
            times["explicit"].append(run(root, chosen[1], chosen[0])[0])
            times["unplanned"].append(run(root, chosen[1], chosen[0], budget=False)[0])
    medians = {side: statistics.median(values) for side, values in times.items()}
    print(f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs; chosen: {chosen[0]} layout on "
          f"{chosen[1]}")
    for side, values in times.items():
        print(f"{side:9} median {medians[side]:.1f} s (spread {min(values):.1f}-{max(values):.1f} s; "
              f"{', '.join(f'{v:.1f}' for v in values)})")
    print(f"default / explicit: {medians['default'] / medians['explicit']:.2f}x; explicit (planned) / unplanned: "
          f"{medians['explicit'] / medians['unplanned']:.2f}x")


if __name__ == "__main__":
    main()
