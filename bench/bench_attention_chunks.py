"""The drafter's XLA attention by number of query chunks (design §5): what a 27B-shaped train step takes to
compile, and what the attention takes to run, with the row's 512 blocks in one chunk and in 32 chunks of 16.

Compile: configs/qwen27b.py's train step, the target reduced to its first 4 layers at the real widths (the
drafter reading each of them as a feature layer), compiled from abstract arrays for 2 simulated CPU devices (fsdp 2, the
target's "tensor" layout), `lower` + `compile` timed. Run: the attention's forward and backward alone (the
gradient of a weighted sum of its output with respect to q, k and v) on the 27B drafter's grid (T 4096, stride 8,
B 16) in the configs' 32 chunks of 16 blocks, for a sliding (W 2048) and the full layer, one row, fp32, the heads
cut to 8/2 x 128 so that a CPU round stays short; every call timed after a warm-up.

Each compile is a fresh process, the rounds alternating the chunkings (and, with --baseline DIR, this checkout and
another revision's checkout DIR, whose dflash_jax that process imports instead); the runs alternate call by call in
one process between this checkout's attention and, with --baseline-attention FILE, another revision's
ops/dflash_attention.py loaded beside it. Load that comes and goes so touches every side alike. Each figure is
the median over the rounds with its spread.

    .venv/bin/python bench/bench_attention_chunks.py [--rounds 3] [--run-rounds 6] [--what compile,run]
        [--baseline DIR] [--baseline-attention FILE]
    (git show REV:dflash_jax/ops/dflash_attention.py > FILE; git archive REV | tar -x -C DIR)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHUNKINGS = {"1 chunk of 512 blocks": 512, "32 chunks of 16 blocks": 16}


def compile_seconds(chunk_blocks: int, target_layers: int = 4) -> float:
    """`lower` + `compile` of configs/qwen27b.py's step (target cut to target_layers) for 2 CPU devices."""
    import dataclasses
    import importlib.util

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.models.qwen3_5 import Qwen3_5
    from dflash_jax.sharding import batch_sharding, make_mesh, state_shardings
    from dflash_jax.train.state import state_spec
    from dflash_jax.train.step import BATCH_KEYS, abstract_schedule_length, make_step
    from dflash_jax.train.validate import dtype_of, resolve_drafter_config, validate_config

    spec = importlib.util.spec_from_file_location("qwen27b", ROOT / "configs" / "qwen27b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.target_dir, config.data.train_files = "(abstract)", ("(abstract)",)
    config.data.batch_size = 2
    # one feature per layer of the reduced target (fc 4*H wide instead of 5*H)
    config.drafter.num_feature_layers, config.drafter.target_layer_ids = target_layers, tuple(range(target_layers))
    config.mesh.fsdp, config.target_layout, config.attention_impl = 2, "tensor", "xla"
    config.query_chunk_blocks = chunk_blocks
    validate_config(config)
    full = module.target_config()
    target_config = dataclasses.replace(full, num_hidden_layers=target_layers,
                                        layer_types=full.layer_types[:target_layers])
    drafter_config = resolve_drafter_config(config, target_config, tokenizer=None)
    mesh = make_mesh(1, 2, 1, devices=jax.devices()[:2])
    target = nnx.eval_shape(lambda: Qwen3_5(target_config, param_dtype=dtype_of(config.target_dtype),
                                            rngs=nnx.Rngs(0)))
    target_graphdef, target_state = nnx.split(target)
    target_shardings = state_shardings(target_state, mesh, config.target_layout)
    state = state_spec(drafter_config, config, "xla", mesh)
    step = make_step(config, drafter_config, state, target_graphdef, target_shardings, mesh)
    batch = {key: jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32,
                                       sharding=batch_sharding(mesh)) for key in BATCH_KEYS}
    target_abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target_state,
                                   target_shardings)
    start = time.perf_counter()
    step.train_step.lower(state.abstract, target_abstract, batch, abstract_schedule_length(mesh)).compile()
    return time.perf_counter() - start


def attention_times(chunk_blocks: int, window: int | None, rounds: int, baseline: Path | None
                    ) -> dict[str, list[float]]:
    """Seconds of the attention's forward + backward on the 27B drafter's grid (heads 8/2 x 128), per round,
    for this checkout's dflash_attention and, given, a baseline file of it (another revision's
    ops/dflash_attention.py, loaded beside it), alternating call by call in this one process."""
    import importlib.util

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.ops import dflash_attention as current
    from dflash_jax.ops.anchors import AnchorGrid

    implementations = {"this checkout": current.dflash_attention}
    if baseline is not None:
        spec = importlib.util.spec_from_file_location("baseline_dflash_attention", baseline)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
        spec.loader.exec_module(module)
        implementations["baseline"] = module.dflash_attention
    grid = AnchorGrid(4096, 8, 16)
    keys = jax.random.split(jax.random.key(0), 6)
    queries, context = (1, grid.num_queries), (1, grid.seq_len)
    q = jax.random.normal(keys[0], (*queries, 8, 128))
    k_ctx, v_ctx = (jax.random.normal(key, (*context, 2, 128)) for key in keys[1:3])
    k_blk, v_blk = (jax.random.normal(key, (*queries, 2, 128)) for key in keys[3:5])
    cotangent = jax.random.normal(keys[5], q.shape)
    segments = jnp.asarray(np.repeat([[0, 1]], grid.seq_len // 2, axis=1))  # two documents
    inputs = (q, k_ctx, v_ctx, k_blk, v_blk)

    def gradient(attention):
        def loss(*arrays):
            out = attention(*arrays, segments, segments[:, grid.anchors], grid, window, 128**-0.5,
                            query_chunk_blocks=chunk_blocks)
            return jnp.sum(out * cotangent)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

    steps = {name: gradient(attention) for name, attention in implementations.items()}
    for step in steps.values():
        jax.block_until_ready(step(*inputs))  # compile and warm up
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*inputs))
            times[name].append(time.perf_counter() - start)
    return times


def compile_in_process(source: Path, chunk_blocks: int) -> float:
    """One compile of the step in a fresh process importing dflash_jax from `source`."""
    args = [sys.executable, str(Path(__file__).resolve()), "--child", "--chunk-blocks", str(chunk_blocks)]
    env = {**os.environ, "PYTHONPATH": str(source), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = subprocess.run(args, capture_output=True, text=True, env=env, cwd=source)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="compiles of each chunking")
    parser.add_argument("--run-rounds", type=int, default=6, help="timed runs of each attention and chunking")
    parser.add_argument("--what", default="compile,run", help="compile, run or both")
    parser.add_argument("--baseline", type=Path, help="another revision's checkout, compiled alternately")
    parser.add_argument("--baseline-attention", type=Path,
                        help="another revision's ops/dflash_attention.py, run alternately in the same process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"seconds": compile_seconds(args.chunk_blocks)}))
        return

    lines = []
    if "compile" in args.what:
        sources = {"this checkout": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name, blocks in CHUNKINGS.items():
                for side, source in sources.items():
                    seconds = compile_in_process(source, blocks)
                    times.setdefault((name, side), []).append(seconds)
                    print(f"compile, {name}, {side}: {seconds:.1f} s", file=sys.stderr, flush=True)
        lines += ["| compile, 27B-shaped step (4 target layers) | chunks | " + " | ".join(sources) + " |",
                  "| --- | --- | " + " | ".join("---:" for _ in sources) + " |"]
        lines += [f"| | {name} | " + " | ".join(spread(times[name, side]) for side in sources) + " |"
                  for name in CHUNKINGS]
    if "run" in args.what:
        sides = ["this checkout"] + (["baseline"] if args.baseline_attention else [])
        lines += ["", "| attention forward + backward | chunks | " + " | ".join(sides) + " |",
                  "| --- | --- | " + " | ".join("---:" for _ in sides) + " |"]
        name = "32 chunks of 16 blocks"  # the configs' chunking (one chunk takes minutes a call on CPU)
        for layer, window in (("sliding W 2048", 2048), ("full", None)):
            times = attention_times(CHUNKINGS[name], window, args.run_rounds, args.baseline_attention)
            print(f"run, {layer}, {name}: {times}", file=sys.stderr, flush=True)
            lines.append(f"| {layer} layer | {name} | " + " | ".join(spread(times[side]) for side in sides) + " |")
    print(f"{datetime.date.today()}; {cpu_model()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
