"""Temporary memory of the target's attention with dense vs query-chunked XLA attention, from XLA's memory
analysis (abstract compile, nothing allocated), measured in one run.

Qwen3-8B shapes (32/8 heads x 128; for the forward also H=4096, I=12288, V=151936, bf16 weights), one row of
T tokens: (1) `causal_attention` alone on one layer's bf16 q/k/v, (2) the target forward with --layers decoder
layers and features after each. "dense" is one chunk of T queries, exactly the former whole-row [T, T] form;
"chunked" is the default QUERY_CHUNK.

    .venv/bin/python -m bench.bench_target_attention_memory [--layers 2] [--seq-len 4096] [--append bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.models.target import CAUSAL_ATTENTION_IMPLS
from dflash_jax.ops.attention import QUERY_CHUNK, causal_attention

HEADING = "## Target attention temporary memory: dense vs query chunks (XLA memory analysis)"
GIB = 1024**3


def temp_bytes(function, *abstract_args) -> int:
    return jax.jit(function).lower(*abstract_args).compile().memory_analysis().temp_size_in_bytes


def attention_alone(config: Qwen3Config, seq_len: int, query_chunk: int) -> int:
    def shape(heads):
        return jax.ShapeDtypeStruct((1, seq_len, heads, config.head_dim), jnp.bfloat16)

    attend = functools.partial(causal_attention, scale=config.head_dim**-0.5, query_chunk=query_chunk)
    kv = shape(config.num_key_value_heads)
    return temp_bytes(attend, shape(config.num_attention_heads), kv, kv,
                      jax.ShapeDtypeStruct((1, seq_len), jnp.int32))


def forward(config: Qwen3Config, seq_len: int, query_chunk: int) -> int:
    """The jitted target forward, its "xla" attention run with `query_chunk` queries per chunk."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(config, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    layers = tuple(range(config.num_hidden_layers))

    def run(state, input_ids, positions, segment_ids):
        out = nnx.merge(graphdef, state)(input_ids, positions, segment_ids, layers)
        return out.hidden, out.features

    original = CAUSAL_ATTENTION_IMPLS["xla"]
    CAUSAL_ATTENTION_IMPLS["xla"] = functools.partial(causal_attention, query_chunk=query_chunk)
    try:
        rows = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
        return temp_bytes(run, state, rows, rows, rows)
    finally:
        CAUSAL_ATTENTION_IMPLS["xla"] = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--append", type=argparse.FileType("a"), help="append the markdown section to this file")
    args = parser.parse_args()

    config = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rope_theta=1e6)
    rows = []
    for name, measure in (("attention alone (one layer)", attention_alone),
                          (f"target forward, {args.layers} layers", forward)):
        dense, chunked = (measure(config, args.seq_len, chunk) for chunk in (args.seq_len, QUERY_CHUNK))
        rows.append(f"| {name} | {dense / GIB:.2f} GiB | {chunked / GIB:.2f} GiB |")
    scores = config.num_attention_heads * args.seq_len**2 * 4
    text = "\n".join([
        HEADING, "",
        f"Command: `.venv/bin/python -m bench.bench_target_attention_memory --layers {args.layers} "
        f"--seq-len {args.seq_len}`",
        f"Date: {datetime.date.today().isoformat()}. Machine: {platform.processor() or platform.machine()}, "
        f"jax {jax.__version__}, backend {jax.default_backend()}; abstract compile, nothing allocated.", "",
        f"Qwen3-8B shapes, 1 row of T={args.seq_len}, bf16. One layer's fp32 scores over the whole row are "
        f"32 x T x T x 4 = {scores / GIB:.2f} GiB; one {QUERY_CHUNK}-query chunk's at most "
        f"{scores * QUERY_CHUNK / args.seq_len / GIB:.2f} GiB.", "",
        f"| XLA temp | dense (one chunk of T queries) | chunked ({QUERY_CHUNK} queries) |", "|---|---:|---:|",
        *rows, ""])
    print(text)
    if args.append:
        args.append.write("\n" + text)


if __name__ == "__main__":
    main()
