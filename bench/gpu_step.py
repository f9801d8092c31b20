"""The whole train step on one GPU host, timed: a random-weight Qwen3-8B-shaped target (built from its config,
nothing downloaded) and the design §11 drafter at T = 4096, 512 anchors (stride 8), B = 16 rows, bf16, the
target's attention on cuDNN (attention_impl "auto" on GPU). Reports the step time, tokens per second and the
MFU of the model FLOP count (dflash_jax/train/flops.py) against the devices' bf16 peak (H200: 989 TFLOP/s),
beside the plan's roofline prediction for the same compiled step (dflash_jax/planning/roofline.py: its FLOPs, HBM and
NVLink bytes over the chip's peaks), and writes them as JSON and markdown to --out (bench/gpu.sh runs it on an
NVIDIA host). The target's layout is config.target_layout "auto" settled for these devices.

    python -m bench.gpu_step [--out out/gpu] [--steps 10] [--remat none]
    python -m bench.gpu_step --tiny [--chip H200]  # tiny shapes on any backend: the script end to end

The devices of the host form one mesh, rows over fsdp (8 x H200: fsdp = 8, 2 rows per GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dflash_jax.planning.chips import chip_named, chip_of_kind
from dflash_jax.planning.hlo_cost import hlo_cost
from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.planning.plan import device_memory_gib, target_bytes_by_layout
from dflash_jax.planning.roofline import roofline
from dflash_jax.sharding import auto_target_layout, make_mesh, state_shardings
from dflash_jax.train import flops, validate
from dflash_jax.train.config import base_config
from dflash_jax.train.state import init_train_state, state_spec
from dflash_jax.train.step import make_step, put_batch, schedule_length

# Qwen3-8B's architecture (its config.json on the Hugging Face Hub).
QWEN3_8B = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                       max_position_embeddings=40960)
TINY_TARGET = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def step_config(tiny: bool, remat: str, peak_tflops: float | None):
    """base_config (the design §11 drafter) at the benchmark's shapes; --tiny shrinks everything."""
    config = base_config()
    config.target_dir, config.data.train_files = "(random weights)", ("(random rows)",)
    config.data.seq_len, config.data.anchor_stride, config.data.batch_size = 4096, 8, 16
    config.drafter.mask_token_id = 151669  # an unused row of Qwen3's embedding, as a tokenizer's mask token
    config.total_steps = 1000  # the schedule's length (the benchmark times a few of its steps)
    config.remat = remat
    config.peak_tflops_per_device = peak_tflops  # None: the device kind's (chips.py)
    if tiny:
        config.data.seq_len, config.data.batch_size = 128, 2
        config.drafter.num_hidden_layers, config.drafter.layer_types = 2, ("full_attention",) * 2
        config.drafter.num_attention_heads, config.drafter.num_key_value_heads, config.drafter.head_dim = 4, 2, 16
        config.drafter.num_feature_layers, config.drafter.mask_token_id = 2, 500
        config.loss.vocab_chunk, config.loss.row_chunk = 256, 64
    validate.validate_config(config)
    return config


def random_rows(config, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows of random tokens, each packing two documents (the second starts at 3T/5), all of them trained."""
    rng = np.random.default_rng(seed)
    rows, length = config.data.batch_size, config.data.seq_len
    split = 3 * length // 5
    positions = np.concatenate([np.arange(split), np.arange(length - split)])
    segments = (np.arange(length) >= split).astype(np.int32)
    return {"input_ids": rng.integers(0, vocab, (rows, length), dtype=np.int32),
            "positions": np.broadcast_to(positions, (rows, length)).astype(np.int32),
            "segment_ids": np.broadcast_to(segments, (rows, length)).copy(),
            "loss_mask": np.ones((rows, length), np.int32)}


def run(tiny: bool, steps: int, warmup: int, remat: str, peak_tflops: float | None = None,
        chip_name: str | None = None) -> dict:
    config = step_config(tiny, remat, peak_tflops)
    target_config = TINY_TARGET if tiny else QWEN3_8B
    mesh = make_mesh(1, -1, 1)
    attention_impl = resolve_attention_impl(config.attention_impl)
    dtype = validate.dtype_of(config.target_dtype)
    abstract = nnx.eval_shape(lambda: Qwen3(target_config, param_dtype=dtype, rngs=nnx.Rngs(0),
                                            attention_impl=attention_impl, mesh=mesh))
    target_graphdef, target_abstract = nnx.split(abstract)
    memory_gib = device_memory_gib(jax.devices()[0])
    config.target_layout = auto_target_layout(target_bytes_by_layout(target_abstract, mesh),
                                              None if memory_gib is None else memory_gib * 2**30)
    target_shardings = state_shardings(target_abstract, mesh, config.target_layout)
    # Random weights made on the devices, each on its shard (a host copy of 16 GB would only slow this down).
    target_state = jax.jit(lambda: nnx.state(Qwen3(target_config, param_dtype=dtype, rngs=nnx.Rngs(0))),
                           out_shardings=target_shardings)()
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer=None)
    spec = state_spec(drafter_config, config, attention_impl, mesh)
    state = init_train_state(drafter_config, config, attention_impl, spec)
    step = make_step(config, drafter_config, spec, target_graphdef, target_shardings, mesh).train_step
    batch = put_batch(random_rows(config, target_config.vocab_size), mesh)

    started = time.perf_counter()
    total_steps = schedule_length(config.total_steps, mesh)
    compiled = step.lower(state, target_state, batch, total_steps).compile()
    compile_s = time.perf_counter() - started
    times = []
    for index in range(warmup + steps):
        started = time.perf_counter()
        state, metrics = compiled(state, target_state, batch, total_steps)
        jax.block_until_ready((state, metrics))
        if index >= warmup:
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    step_flops = flops.train_step_flops(config, target_config, drafter_config)
    device = jax.devices()[0]
    peak = flops.peak_tflops(config, device)
    memory = device.memory_stats() or {}
    chip = chip_named(chip_name) if chip_name else chip_of_kind(device.device_kind)
    tokens = config.data.batch_size * config.data.seq_len
    predicted = None if chip is None else roofline(
        hlo_cost(compiled.as_text(), dict(mesh.shape)), step_flops / mesh.size, chip, tokens, steps)
    return {
        "device": f"{mesh.size} x {device.device_kind}", "platform": device.platform,
        "target": "Qwen3-8B shapes, random bf16 weights" if not tiny else "tiny Qwen3 (--tiny)",
        "seq_len": config.data.seq_len, "anchors": config.data.seq_len // config.data.anchor_stride,
        "batch_size": config.data.batch_size, "attention_impl": attention_impl, "remat": remat,
        "target_layout": config.target_layout,
        "mesh": dict(mesh.shape), "compile_s": round(compile_s, 2), "steps_timed": steps,
        "step_s": step_s, "step_s_all": times,
        "tokens_per_s": config.data.batch_size * config.data.seq_len / step_s,
        "model_tflops_per_step": step_flops / 1e12,
        "peak_tflops_per_device": peak,
        "mfu": None if peak is None else step_flops / (mesh.size * peak * 1e12 * step_s),
        "peak_memory_gib": memory.get("peak_bytes_in_use", 0) / 2**30 or None,
        "predicted_chip": None if chip is None else chip.name,
        "predicted_step_s": None if predicted is None else list(predicted.step_seconds),
        "predicted_bound": None if predicted is None else predicted.bound,
        "predicted_seconds": None if predicted is None else predicted.seconds,
        "loss": float(metrics["loss"]),
        "jax": jax.__version__, "host": platform.node(),
    }


def markdown(result: dict) -> str:
    mfu = "n/a" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
    memory = "n/a" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f} GiB"
    predicted = "n/a" if result["predicted_step_s"] is None else (
        "{:.3f}-{:.3f} s on {}, {}-bound".format(*result["predicted_step_s"], result["predicted_chip"],
                                               result["predicted_bound"]))
    return "\n".join([
        f"train step on {result['device']} ({result['target']}; T = {result['seq_len']}, {result['anchors']} "
        f"anchors, B = {result['batch_size']}, attention {result['attention_impl']}, remat {result['remat']}, "
        f"mesh {result['mesh']}, jax {result['jax']})",
        "",
        "| step time | predicted (roofline) | tokens/s | model TFLOP per step | MFU | peak memory per device | "
        "compile |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {result['step_s']:.3f} s (median of {result['steps_timed']}) | {predicted} | "
        f"{result['tokens_per_s']:,.0f} | {result['model_tflops_per_step']:.4g} | {mfu} | {memory} | "
        f"{result['compile_s']:.0f} s |",
        ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "out/gpu", help="where the figures go")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after the warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--remat", default="none", help="config.remat of the drafter layers")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="bf16 peak TFLOP/s per device for the MFU (default: the device kind's; H200 989)")
    parser.add_argument("--chip", default=None, help="the chip whose peaks the roofline prediction uses "
                        "(dflash_jax/planning/chips.py; default: the device kind's)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (any backend): the script end to end")
    args = parser.parse_args()
    if args.tiny:  # the tiny step only checks the wiring; XLA:CPU's full optimisation would take longer than it
        jax.config.update("jax_disable_most_optimizations", True)
    result = run(args.tiny, args.steps, args.warmup, args.remat, args.peak_tflops, args.chip)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_step.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gpu_step.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
