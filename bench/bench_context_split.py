"""A long row whole on one device against the same row split over context = 2, 4 and 8 simulated devices
(design §19): the train step's memory per device (XLA's memory analysis of the compiled step: arguments plus
temporaries) and its time, for a toy-sized hybrid target (tests/train_fixtures.py's 8-layer Qwen3.5, six Gated
DeltaNet and two attention layers) and configs/tiny.py's drafter (a sliding and a full layer), one row a step.

The simulated devices share this machine's cores, so the step times say what the split costs in work on one
host, not how fast N chips run it; the memory per device is what the split is for.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m bench.bench_context_split \
        [--lengths 4096,16384] [--rounds 3]   # --lengths 32768 --rounds 0: memory alone
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax

from dflash_jax.train.step import put_batch
from tests.train_fixtures import build, make_qwen3_5_target, mesh_of, tiny_config, write_corpus

MIB = 2**20


def measure(files: dict, length: int, context: int, rounds: int) -> tuple[float, float, list[float]]:
    """(arguments MiB, temporaries MiB) per device and the step times (s) of `rounds` steps after the first."""
    config = tiny_config(files["target"], files["corpus"], **{
        "data.seq_len": length, "data.batch_size": 1, "mesh.context": context, "loss.row_chunk": 256})
    setup = build(config, mesh_of(context=context))
    batch = put_batch(next(setup.loader), setup.mesh)
    compiled = setup.step.train_step.lower(setup.state, setup.target_state, batch, setup.total_steps).compile()
    memory = compiled.memory_analysis()
    state, times = setup.state, []
    for round_ in range(rounds + 1 if rounds else 0):
        start = time.perf_counter()
        state, metrics = compiled(state, setup.target_state, batch)
        jax.block_until_ready(metrics)
        if round_:  # the first call is not timed
            times.append(time.perf_counter() - start)
    return memory.argument_size_in_bytes / MIB, memory.temp_size_in_bytes / MIB, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--contexts", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps (0: memory only, nothing run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        files = {"target": make_qwen3_5_target(root / "target"), "corpus": write_corpus(root / "train.jsonl")}
        print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"{len(jax.devices())} simulated devices, jax {jax.__version__}")
        print("| row tokens | context | tokens a device | arguments MiB | temporaries MiB | step s (median, range) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for length in map(int, args.lengths.split(",")):
            for context in map(int, args.contexts.split(",")):
                arguments, temporaries, times = measure(files, length, context, args.rounds)
                timing = f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})" if times else "-"
                print(f"| {length} | {context} | {length // context} | {arguments:.1f} | {temporaries:.1f} | "
                      f"{timing} |", flush=True)


if __name__ == "__main__":
    main()
