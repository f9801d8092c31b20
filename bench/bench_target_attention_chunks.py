"""Time of the targets' XLA causal attention (`ops/attention.py` `causal_attention`, forward only: the target
is frozen) by query chunk size, the sizes alternating within each round, medians; with XLA's temporary memory
of each size. This is what chose the XLA path's query chunk per platform (`QUERY_CHUNK_BY_PLATFORM`;
bench/RESULTS.md); GPUs run cuDNN's fused kernel and TPUs the splash kernel, whose tiling is their own, so
the XLA chunk only matters where those cannot run.

    .venv/bin/python -m bench.bench_target_attention_chunks [--shapes toy,B,qwen3_8b] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from configs import toy
from dflash_jax.ops.attention import causal_attention, default_query_chunk


class Shape(NamedTuple):
    rows: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int


def demo_shape() -> Shape:
    """`make demo`'s target: configs/toy.py's rows at the toy target's attention widths, read from those files so
    that the benchmark follows the demo."""
    config = toy.get_config()
    target = json.loads((Path(config.target_dir) / "config.json").read_text())
    return Shape(rows=config.data.batch_size, seq_len=config.data.seq_len, q_heads=target["num_attention_heads"],
                 kv_heads=target["num_key_value_heads"], head_dim=target["head_dim"])


SHAPES = {
    "toy": demo_shape(),
    "B": Shape(rows=2, seq_len=2048, q_heads=8, kv_heads=2, head_dim=128),  # bench/peer_step.py's shape B
    "qwen3_8b": Shape(rows=1, seq_len=4096, q_heads=32, kv_heads=8, head_dim=128),
}


def attention_call(shape: Shape, query_chunk: int):
    def operand(key, heads):
        return jax.random.normal(key, (shape.rows, shape.seq_len, heads, shape.head_dim), jnp.float32)

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = operand(keys[0], shape.q_heads), operand(keys[1], shape.kv_heads), operand(keys[2], shape.kv_heads)
    # Two documents per row, so the segment mask is exercised as in packed training rows.
    segments = jnp.asarray(np.repeat([[1, 2]], shape.seq_len // 2, axis=1).repeat(shape.rows, axis=0), jnp.int32)
    attend = jax.jit(functools.partial(causal_attention, scale=shape.head_dim**-0.5, query_chunk=query_chunk))
    compiled = attend.lower(q, k, v, segments).compile()
    return (lambda: compiled(q, k, v, segments).block_until_ready()), compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="toy,B,qwen3_8b", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--chunks", default="64,128,256,512,1024,2048", help="query chunk sizes")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} cores; fp32; default query chunk "
          f"{default_query_chunk()}; load average before {os.getloadavg()[0]:.1f}")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        # causal_attention takes at most half a row per chunk (its halves rule); sizes above that are that.
        sizes = sorted({min(int(c), -(-shape.seq_len // 2)) for c in args.chunks.split(",")})
        calls = {size: attention_call(shape, size) for size in sizes}
        times = {size: [] for size in sizes}
        for _ in range(args.rounds):
            for size, (call, _) in calls.items():
                call()  # warm
                start = time.perf_counter()
                call()
                times[size].append(time.perf_counter() - start)
        print(f"\n{name}: {shape.rows} x {shape.seq_len} tokens, {shape.q_heads}/{shape.kv_heads} heads x "
              f"{shape.head_dim}\n\n| query chunk | median | XLA temp |\n|---:|---:|---:|")
        for size in sizes:
            print(f"| {size} | {1e3 * np.median(times[size]):.1f} ms | {calls[size][1] / 2**20:.0f} MiB |")
    print(f"\nload average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
