"""Temporary memory of the train step on the Qwen3.6-27B shapes, from XLA's memory analysis (nothing allocated).

The train step is lowered and compiled for CPU on abstract inputs (ShapeDtypeStructs) for three anchor
strides, and `compiled.memory_analysis()` gives its temporary buffer bytes. The drafter's LM head + cross-
entropy and the target's greedy labels run in chunks (design §6), so the temporaries must not grow like the
N·B × V fp32 logits they would otherwise need. The temporaries also hold things that do grow with N·B but not
with V (drafter activations, attention scores), so each anchor count is compiled twice, at V and at V/2:
temp is affine in V, and 2 × (temp(V) − temp(V/2)) is the part that depends on V at all.
To keep CPU compile time sane, the target keeps its real widths (H, V, heads, MLP) but only its first
`--target-layers` layers; the drafter's 5 feature ids are spread over those (design §2 rule), same fc width n·H.

    .venv/bin/python -m bench.bench_step_memory [--config configs/qwen27b.py] [--append bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import platform
import time

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.qwen3_5 import Qwen3_5
from dflash_jax.sharding import batch_sharding, make_mesh, state_shardings
from dflash_jax.train.state import state_spec
from dflash_jax.train.step import BATCH_KEYS, abstract_schedule_length, make_step
from dflash_jax.train.validate import dtype_of, resolve_drafter_config, validate_config

HEADING = "## Train step temporary memory (XLA memory analysis)"
GIB = 1024**3


def load_config_module(path: str):
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_shardings(abstract, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def measure(module, stride: int, target_layers: int, vocab_divisor: int = 1) -> dict:
    """Compile the step for one anchor stride (and V / vocab_divisor); returns the shapes and XLA's figures."""
    config = module.get_config()
    config.target_dir, config.data.train_files = "(abstract)", ("(abstract)",)
    config.data.anchor_stride = stride
    config.data.batch_size = 1  # one row per device
    config.drafter.target_layer_ids = None  # the reduced target: design §2 ids spread over its layers
    config.mesh.fsdp = 1
    config.target_layout = "fsdp"  # the layout of state_shardings below
    validate_config(config)
    full = module.target_config()
    target_config = dataclasses.replace(full, num_hidden_layers=target_layers,
                                        layer_types=full.layer_types[:target_layers],
                                        vocab_size=full.vocab_size // vocab_divisor)
    config.drafter.mask_token_id = min(config.drafter.mask_token_id, target_config.vocab_size - 1)
    drafter_config = resolve_drafter_config(config, target_config, tokenizer=None)

    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    target = nnx.eval_shape(lambda: Qwen3_5(target_config, param_dtype=dtype_of(config.target_dtype),
                                            rngs=nnx.Rngs(0)))
    target_graphdef, target_state = nnx.split(target)
    target_shardings = state_shardings(target_state, mesh)
    spec = state_spec(drafter_config, config, "xla", mesh)
    step = make_step(config, drafter_config, spec, target_graphdef, target_shardings, mesh)
    batch = {key: jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32, sharding=batch_sharding(mesh))
             for key in BATCH_KEYS}
    start = time.perf_counter()
    compiled = step.train_step.lower(spec.abstract, with_shardings(target_state, target_shardings), batch,
                                     abstract_schedule_length(mesh)).compile()
    memory = compiled.memory_analysis()
    anchors = config.data.seq_len // stride
    return {
        "anchors": anchors, "stride": stride, "queries": anchors * config.drafter.block_size,
        "logits_bytes": anchors * config.drafter.block_size * target_config.vocab_size * 4,
        "temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes,
        "compile_seconds": time.perf_counter() - start, "config": config, "target_config": target_config,
        "drafter_config": drafter_config,
    }


def report(results: list[dict], halves: list[dict], args) -> str:
    first = results[0]
    config, target, drafter = first["config"], first["target_config"], first["drafter_config"]
    lines = [
        HEADING, "",
        f"Command: `.venv/bin/python -m bench.bench_step_memory --config {args.config} "
        f"--target-layers {args.target_layers}`",
        f"Date: {datetime.date.today().isoformat()}. Machine: {platform.processor() or platform.machine()}, "
        f"jax {jax.__version__}, backend {jax.default_backend()}; abstract compile, nothing allocated.",
        "",
        f"Shapes: V={target.vocab_size}, H={target.hidden_size}, T={config.data.seq_len}, block B={config.drafter.block_size}, "
        f"{config.data.batch_size} row per device; drafter {drafter.num_hidden_layers} layers "
        f"{list(drafter.layer_types)} (W={drafter.sliding_window}), {drafter.num_attention_heads}/"
        f"{drafter.num_key_value_heads} heads x {drafter.head_dim}, I={drafter.intermediate_size}, "
        f"fc {len(drafter.target_layer_ids)}*H; loss_row_chunk={config.loss.row_chunk}, "
        f"vocab_chunk={config.loss.vocab_chunk}, query_chunk_blocks={config.query_chunk_blocks}; "
        f"target {config.target_dtype}, drafter compute {config.compute_dtype}.",
        f"The target is REDUCED to its first {target.num_hidden_layers} layers "
        f"({', '.join(target.layer_types)}) at the real widths (feature ids {list(drafter.target_layer_ids)}), "
        f"so the figures are the drafter's and the loss's plus a few target layers, not a full 27B step.",
        "",
        "| anchors N (stride) | N·B | N·B × V × 4 (dense fp32 logits) | XLA temp at V | at V/2 | V-dependent part "
        "2·(temp(V) − temp(V/2)) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r, half in zip(results, halves):
        v_part = 2 * (r["temp_bytes"] - half["temp_bytes"])
        lines.append(f"| {r['anchors']} ({r['stride']}) | {r['queries']} | {r['logits_bytes'] / GIB:.2f} GiB | "
                     f"{r['temp_bytes'] / GIB:.2f} GiB | {half['temp_bytes'] / GIB:.2f} GiB | {v_part / GIB:.2f} GiB |")
    low, high = results[0], results[-1]
    growth = [2 * (r["temp_bytes"] - h["temp_bytes"]) for r, h in ((low, halves[0]), (high, halves[-1]))]
    compile_times = ", ".join(f"{r['compile_seconds']:.0f} s" for r in results + halves)
    lines += ["", f"From {low['anchors']} to {high['anchors']} anchors the dense logits would grow by "
                  f"{(high['logits_bytes'] - low['logits_bytes']) / GIB:.2f} GiB; the V-dependent temporaries "
                  f"changed by {(growth[1] - growth[0]) / GIB:+.2f} GiB. All temporaries together changed by "
                  f"{(high['temp_bytes'] - low['temp_bytes']) / GIB:+.2f} GiB: growth with N·B that does not "
                  f"involve V. Compile times: {compile_times}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen27b.py", help="needs get_config() and target_config()")
    parser.add_argument("--target-layers", type=int, default=8, help="target layers kept (two hybrid periods)")
    parser.add_argument("--strides", default="32,16,8", help="anchor strides: 128, 256, 512 anchors at T=4096")
    parser.add_argument("--append", default=None, help="append the markdown section to this file")
    args = parser.parse_args()

    module = load_config_module(args.config)
    results, halves = [], []
    for stride in (int(s) for s in args.strides.split(",")):
        for divisor, out in ((1, results), (2, halves)):
            out.append(measure(module, stride, args.target_layers, divisor))
            r = out[-1]
            print(f"stride {stride}, V={r['target_config'].vocab_size}: {r['anchors']} anchors, temp "
                  f"{r['temp_bytes'] / GIB:.2f} GiB (dense logits {r['logits_bytes'] / GIB:.2f} GiB), compiled in "
                  f"{r['compile_seconds']:.0f} s", flush=True)
    text = report(results, halves, args)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
