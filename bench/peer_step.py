"""The project's drafter train step side by side with speculators' (vLLM's PyTorch DFlash trainer).

    make bench-peer        # = .venv/bin/python -m bench.peer_step (builds .venv-speculators first)

Per shape, both sides train the same drafter shape on the same inputs (features and the target's last hidden
state from one seeded stream, one packed row of T tokens, one document, N anchors of B slots), fp32, AdamW,
clip 1.0, on this machine's CPU cores. speculators 0.9.0 runs in its own venv (`bench/speculators/`) with
sdpa attention and its eager CE loss; its step is what its trainer does per batch: the forward (random
anchors, the dense mask, the frozen verifier head's targets, the drafter, logits, loss, metrics), backward,
clip, AdamW. The project's drafter step: the target's greedy labels (its LM head over the labelled rows), the
drafter forward/backward with the fused LM-head cross-entropy, clip + AdamW, one jitted call. Rounds alternate
the two sides (the order flips every round) and report medians, so machine load hits both alike (a shape whose
two sides do not fit in the available memory together runs them one after the other, and says so), 6 rounds by
default, each figure with the spread of its per-round medians; the load average before and after, the CPU model,
its cores and each side's thread settings are printed with every shape. The project's whole step (an 8-layer target's forward inside) and a
breakdown of its parts follow, so a regression shows where it is. Last, for the --bf16-shapes, the project's
drafter step with bf16 compute against fp32 and a square matmul's rate in each dtype (does bf16 pay on this
CPU?).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs import toy
from dflash_jax.models.dflash import TargetContext, target_labels
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.models.layers import rope_frequencies
from dflash_jax.models.qwen3 import Qwen3, Qwen3Config
from dflash_jax.ops.anchors import DrafterInputs, slot_mask
from dflash_jax.ops.dflash_attention import dflash_attention
from dflash_jax.sharding import make_mesh, state_shardings
from dflash_jax.train.config import base_config
from dflash_jax.train.loss import lm_head_cross_entropy, trained_slot_count
from dflash_jax.train.optimizer import make_optimizer
from dflash_jax.train.state import init_train_state, state_spec
from dflash_jax.train.step import anchor_grid, make_step

ROOT = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
WORKER = ROOT / "bench" / "speculators" / "speculators_step.py"


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    seq_len: int
    stride: int  # anchors N = seq_len / stride
    block: int
    gamma: float
    features: int  # target feature layers fed to fc
    target_layers: int  # of the random target in the whole step (0: no whole step)
    rows: int = 1  # packed rows per step; speculators trains one, so only 1-row shapes are compared
    optimizer: str = "adamw"  # the project's config.optim.name (speculators' side is always AdamW)
    vocab_chunk: int = 8192  # the project's config.loss.vocab_chunk
    seed: int = 0

    def memory_estimate(self) -> int:
        """Bytes both sides hold at once, roughly: per side the drafter's weights, gradients and AdamW moments,
        a few [N*B, V] fp32 logit temporaries (speculators keeps whole ones) and one fp32 [H, V] vocabulary
        matrix (speculators' embedding, LM head and verifier head share one, none allocated before it)."""
        attention = 2 * self.hidden * self.head_dim * (self.q_heads + self.kv_heads)
        weights = self.layers * (attention + 3 * self.hidden * self.intermediate) + self.features * self.hidden ** 2
        logits = self.rows * self.seq_len // self.stride * self.block * self.vocab
        return 4 * 2 * (4 * weights + 4 * logits + self.vocab * self.hidden)


SHAPES = {
    "A": Shape(hidden=256, layers=2, q_heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=4096,
               seq_len=1024, stride=16, block=8, gamma=4.0, features=3, target_layers=8),
    "B": Shape(hidden=1024, layers=2, q_heads=8, kv_heads=2, head_dim=128, intermediate=3072, vocab=32000,
               seq_len=2048, stride=16, block=16, gamma=7.0, features=3, target_layers=8),
    # Qwen3-8B's drafter widths (z-lab's Qwen3-8B DFlash: H 4096, 32/8 heads x 128, I 12288, V 151936, 5
    # feature layers, B 16), reduced to one layer and T = 512; both sides together need about 16 GB
    # (memory_estimate; where less is available they run one after the other, each about 8 GB); no whole
    # step (the target: 6 GB per 8 layers).
    "qwen3_8b": Shape(hidden=4096, layers=1, q_heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                      vocab=151936, seq_len=512, stride=16, block=16, gamma=7.0, features=5, target_layers=0),
}


def demo_shape() -> Shape:
    """`make demo`'s step: configs/toy.py's rows, anchors, drafter and optimizer at the toy target's widths
    (random weights here), read from those files so that the benchmark follows the demo. The project's side only."""
    config = toy.get_config()
    target = json.loads((Path(config.target_dir) / "config.json").read_text())
    drafter = config.drafter
    return Shape(hidden=target["hidden_size"], layers=drafter.num_hidden_layers, q_heads=drafter.num_attention_heads,
                 kv_heads=drafter.num_key_value_heads, head_dim=drafter.head_dim,
                 intermediate=target["intermediate_size"], vocab=target["vocab_size"], seq_len=config.data.seq_len,
                 stride=config.data.anchor_stride, block=drafter.block_size, gamma=config.loss.gamma,
                 features=drafter.num_feature_layers, target_layers=target["num_hidden_layers"],
                 rows=config.data.batch_size, optimizer=config.optim.name, vocab_chunk=config.loss.vocab_chunk)


SHAPES["toy"] = demo_shape()
# The same step with AdamW (make demo's optimizer before Muon): what Muon's Newton-Schulz adds to the step.
SHAPES["toy_adamw"] = dataclasses.replace(SHAPES["toy"], optimizer="adamw")


def peer_inputs(shape: Shape) -> dict[str, np.ndarray]:
    """What both sides get: features [rows, T, n*H], the target's last hidden state [rows, T, H], token ids
    [rows, T]."""
    rng = np.random.default_rng(shape.seed)
    rows, length, hidden = shape.rows, shape.seq_len, shape.hidden
    return {"features": rng.standard_normal((rows, length, shape.features * hidden), np.float32),
            "target_hidden": rng.standard_normal((rows, length, hidden), np.float32),
            "input_ids": rng.integers(0, shape.vocab - 1, (rows, length), dtype=np.int32)}


class ProjectSide:
    """The project's step functions at one shape, on one CPU device, fp32."""

    def __init__(self, shape: Shape, inputs: dict[str, np.ndarray], query_chunk_blocks: int,
                 compute_dtype: str = "float32"):
        self.shape = shape
        config = base_config()
        config.target_dir, config.data.train_files = "(random)", ("(random)",)
        config.target_dtype, config.compute_dtype = "float32", compute_dtype
        config.target_layout = "fsdp"  # the layout of state_shardings below
        config.optim.name, config.loss.vocab_chunk = shape.optimizer, shape.vocab_chunk
        config.data.seq_len, config.data.anchor_stride, config.data.batch_size = shape.seq_len, shape.stride, shape.rows
        config.drafter.block_size, config.loss.gamma = shape.block, shape.gamma
        config.query_chunk_blocks, config.attention_impl = query_chunk_blocks, "xla"
        self.config, self.grid = config, anchor_grid(config)
        target_config = Qwen3Config(
            vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
            num_hidden_layers=max(shape.target_layers, shape.features + 1), num_attention_heads=shape.q_heads,
            num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, tie_word_embeddings=True)
        self.drafter_config = DrafterConfig(
            hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
            num_attention_heads=shape.q_heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
            rms_norm_eps=1e-6, rope_theta=1e6, layer_types=("full_attention",) * shape.layers,
            block_size=shape.block, target_layer_ids=tuple(range(1, 1 + shape.features)),
            num_target_layers=target_config.num_hidden_layers, mask_token_id=shape.vocab - 1,
            vocab_size=shape.vocab, max_position_embeddings=32768)
        # The random target is only built for the whole step; the drafter step takes its outputs as inputs.
        make_target = lambda: Qwen3(target_config, rngs=nnx.Rngs(1), attention_impl="xla")  # noqa: E731
        self.target_graphdef, self.target_state = nnx.split(
            make_target() if shape.target_layers else nnx.eval_shape(make_target))
        mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
        self.spec = state_spec(self.drafter_config, config, "xla", mesh)
        self.state = init_train_state(self.drafter_config, config, "xla", self.spec)
        self.steps = make_step(config, self.drafter_config, self.spec, self.target_graphdef,
                               state_shardings(self.target_state, mesh), mesh)
        self.tx = make_optimizer(config, total_steps=1)  # the schedule's length changes no work

        shaped = (shape.rows, shape.seq_len)
        self.batch = {"input_ids": jnp.asarray(inputs["input_ids"]),
                      "positions": jnp.broadcast_to(jnp.arange(shape.seq_len, dtype=jnp.int32), shaped),
                      "segment_ids": jnp.ones(shaped, jnp.int32), "loss_mask": jnp.ones(shaped, jnp.int32)}
        self.features = jnp.asarray(inputs["features"])
        self.target_hidden = jnp.asarray(inputs["target_hidden"])
        keys = jax.random.split(jax.random.PRNGKey(shape.seed), 3)
        self.lm_head = jax.random.normal(keys[0], (shape.hidden, shape.vocab)) * shape.hidden**-0.5
        self.block_embeds = jax.random.normal(keys[1], (shape.rows, self.grid.num_queries, shape.hidden))
        self.labels = jax.jit(lambda hidden, head: target_labels(hidden, head, self.grid, config.loss.vocab_chunk))
        self.drafter_step = jax.jit(self._drafter_step, donate_argnums=0)

    def _drafter_step(self, state, features, target_hidden, block_embeds, lm_head, batch):
        """Labels from the target's hidden state, drafter loss forward/backward, clip + AdamW."""
        labels = target_labels(target_hidden, lm_head, self.grid, self.config.loss.vocab_chunk)
        teacher = TargetContext(features=features, labels=labels, block_embeds=block_embeds, lm_head=lm_head)
        normaliser = trained_slot_count(slot_mask(batch["loss_mask"], batch["segment_ids"], self.grid.anchors,
                                                  self.shape.block))
        (loss, _), grads = jax.value_and_grad(self.steps.drafter_loss, has_aux=True)(
            state.params, teacher, batch, jax.random.PRNGKey(0), normaliser)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        return state._replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state), loss

    def drafter_steps(self, count: int) -> Timings:
        def one():
            self.state, loss = self.drafter_step(self.state, self.features, self.target_hidden,
                                                 self.block_embeds, self.lm_head, self.batch)
            return loss
        return timed(one, count)

    def whole_steps(self, count: int) -> Timings:
        def one():
            self.state, metrics = self.steps.train_step(self.state, self.target_state, self.batch, 1)
            return metrics
        return timed(one, count)

    def parts(self) -> dict[str, Callable[[], object]]:
        """The step's parts as separately jitted calls at the step's shapes: forward + backward (cotangents of
        ones) where the step differentiates them."""
        shape, config, grid = self.shape, self.config, self.grid
        drafter = nnx.merge(self.spec.graphdef, self.state.params)
        keys = jax.random.split(jax.random.PRNGKey(shape.seed + 1), 5)
        x = jax.random.normal(keys[0], (shape.rows, grid.num_queries, shape.hidden))
        ctx = jax.random.normal(keys[1], (shape.rows, shape.seq_len, shape.hidden))
        positions, segments = self.batch["positions"], self.batch["segment_ids"]
        inputs = DrafterInputs.from_rows(grid, positions, segments)
        inv_freq = rope_frequencies(shape.head_dim, self.drafter_config.rope_theta)
        attend = functools.partial(dflash_attention, context_segment_ids=segments,
                                   anchor_segment_ids=inputs.anchor_segment_ids, grid=grid,
                                   query_chunk_blocks=config.query_chunk_blocks)
        parts = {}
        if shape.target_layers:
            feature_ids = self.drafter_config.target_layer_ids
            target = jax.jit(lambda state, ids: nnx.merge(self.target_graphdef, state)(
                ids, positions, segments, feature_ids))
            parts[f"target forward ({shape.target_layers} layers)"] = (
                lambda: target(self.target_state, self.batch["input_ids"]))
        parts["labels (target LM head + argmax)"] = lambda: self.labels(self.target_hidden, self.lm_head)
        parts["fc"] = module_gradient(lambda fc, f: fc(f), drafter.fc, self.features, input_grads=False)
        for i, layer in enumerate(drafter.layers):
            def attention(module, h, c):  # the context's keys/values (per layer) and the block queries' attention
                context = module.key_values(c, positions, inv_freq)
                return module(h, context, inputs.block_positions, attend, inv_freq)

            parts[f"attention, layer {i} (projections, norms, RoPE, kernel)"] = module_gradient(
                attention, layer.self_attn, x, ctx)
            parts[f"MLP, layer {i}"] = module_gradient(lambda mlp, h: mlp(h), layer.mlp, x)
        q = jax.random.normal(keys[2], (shape.rows, grid.num_queries, shape.q_heads, shape.head_dim))
        k_ctx = jax.random.normal(keys[3], (shape.rows, shape.seq_len, shape.kv_heads, shape.head_dim))
        k_blk = jax.random.normal(keys[4], (shape.rows, grid.num_queries, shape.kv_heads, shape.head_dim))
        kernel = jax.jit(jax.grad(lambda *qkv: jnp.sum(attend(*qkv, window=None, scale=shape.head_dim**-0.5)),
                                  argnums=(0, 1, 2, 3, 4)))
        parts["  the attention kernel alone, one layer"] = lambda: kernel(q, k_ctx, k_ctx, k_blk, k_blk)
        labels = self.labels(self.target_hidden, self.lm_head).reshape(shape.rows, -1)
        head = jax.jit(jax.grad(lambda h: jnp.sum(
            lm_head_cross_entropy(h, self.lm_head, labels, config.loss.row_chunk)[0])))
        parts["LM head + cross-entropy"] = lambda: head(x[:, :labels.shape[1]])  # the drafted slots' rows
        optimizer = jax.jit(lambda p, s: optax.apply_updates(p, self.tx.update(p, s, p)[0]))
        parts[f"optimizer (clip + {shape.optimizer})"] = lambda: optimizer(self.state.params, self.state.opt_state)
        return parts


def module_gradient(call: Callable, module: nnx.Module, *inputs: jax.Array, input_grads: bool = True):
    """A jitted forward + backward of call(module, *inputs): gradients w.r.t. the module's weights and, if
    input_grads, its inputs, for a cotangent of ones."""
    graphdef, state = nnx.split(module)
    argnums = tuple(range(1 + len(inputs))) if input_grads else 0
    gradient = jax.jit(jax.grad(lambda s, *xs: jnp.sum(call(nnx.merge(graphdef, s), *xs)), argnums=argnums))
    return lambda: gradient(state, *inputs)


class Timings(NamedTuple):
    """Per-step times in seconds: wall clock, and the CPU time of the process (all its threads)."""

    wall: list[float]
    cpu: list[float]

    def __add__(self, other):
        return Timings(self.wall + other.wall, self.cpu + other.cpu)

    def median(self) -> tuple[float, float]:
        return float(np.median(self.wall)), float(np.median(self.cpu))

    def spread(self, steps: int) -> tuple[float, float]:
        """(lowest, highest) of the per-round medians of the wall clock, rounds of `steps` steps."""
        medians = [float(np.median(self.wall[i:i + steps])) for i in range(0, len(self.wall), steps)]
        return min(medians), max(medians)


def timed(call: Callable[[], object], count: int) -> Timings:
    wall, cpu = [], []
    for _ in range(count):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(call())
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return Timings(wall, cpu)


class SpeculatorsSide:
    """speculators' step in its own venv, a subprocess driven line by line (bench/speculators/)."""

    def __init__(self, shape: Shape, inputs_file: str, threads: int):
        spec = dict(vocab=shape.vocab, hidden=shape.hidden, intermediate=shape.intermediate, layers=shape.layers,
                    q_heads=shape.q_heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, block=shape.block,
                    features=shape.features, seq_len=shape.seq_len, stride=shape.stride, gamma=shape.gamma,
                    threads=threads)
        self.process = subprocess.Popen([str(SPECULATORS_PYTHON), str(WORKER), json.dumps(spec), inputs_file],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._reply()

    def _reply(self) -> dict:
        for line in self.process.stdout:  # libraries may print their own lines; ours are JSON objects
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the speculators worker ended (exit code {self.process.wait()})")

    def steps(self, count: int) -> Timings:
        self.process.stdin.write(f"run {count}\n")
        self.process.stdin.flush()
        reply = self._reply()
        return Timings(reply["wall"], reply["cpu"])

    def close(self) -> None:
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait()


def rounds(name: str, sides: list[tuple[str, Callable[[int], Timings]]], args) -> dict[str, Timings]:
    """args.rounds rounds of args.steps steps of each side, alternating and flipping the order every round."""
    times = {side: Timings([], []) for side, _ in sides}
    for round_index in range(args.rounds):
        for side, run in sides[:: 1 if round_index % 2 == 0 else -1]:
            times[side] += run(args.steps)
        print(f"  {name} round {round_index + 1}: " + ", ".join(
            f"{side} {np.median(t.wall[-args.steps:]):.3f} s" for side, t in times.items()), flush=True)
    return times


def compare(name: str, shape: Shape, args, together: bool = True) -> dict:
    """One shape: the two sides alternating (1-row shapes), the project's whole step and its parts.
    together=False (a shape whose two sides do not fit in memory at once): speculators' rounds first, its
    process ended, then the project's."""
    inputs = peer_inputs(shape)
    result = {"shape": dataclasses.asdict(shape), "load_before": os.getloadavg(),
              "dflash_jax_attention": f"xla (query_chunk_blocks={args.query_chunk_blocks})",
              "sides": "alternating" if together or shape.rows > 1 else "one after the other"}
    times = {}
    with tempfile.TemporaryDirectory() as directory:
        theirs = None
        if shape.rows == 1:
            np.savez(os.path.join(directory, "inputs.npz"), **inputs)
            theirs = SpeculatorsSide(shape, os.path.join(directory, "inputs.npz"), args.threads)
            result["speculators_attention"] = theirs.ready["attention"]
            if not together:
                times.update(rounds(name, [("speculators", theirs.steps)], args))
                theirs.close()
        ours = ProjectSide(shape, inputs, args.query_chunk_blocks)
        start = time.perf_counter()
        ours.drafter_steps(1)
        result["compile_s"] = time.perf_counter() - start
        sides = [("dflash_jax", ours.drafter_steps)]
        if theirs is not None and together:
            sides.append(("speculators", theirs.steps))
        times.update(rounds(name, sides, args))
        if theirs is not None and together:
            theirs.close()
    result["machine"] = machine_line(args)
    for side, timings in times.items():
        result[f"{side}_s"], result[f"{side}_cpu_s"] = timings.median()
        result[f"{side}_spread_s"] = timings.spread(args.steps)
    if "speculators_s" in result:
        result["ratio"] = result["speculators_s"] / result["dflash_jax_s"]
        result["cpu_ratio"] = result["speculators_cpu_s"] / result["dflash_jax_cpu_s"]
    if shape.target_layers:
        ours.whole_steps(1)
        result["whole_step_s"], result["whole_step_cpu_s"] = ours.whole_steps(args.rounds * args.steps).median()
    if args.breakdown:
        result["parts"] = {}
        for part, call in ours.parts().items():
            call()
            result["parts"][part] = timed(call, args.rounds).median()
    result["load_after"] = os.getloadavg()
    return result


def matmul_rate(size: int, dtype, count: int) -> float:
    """GFLOP/s of a jitted [size, size] @ [size, size] in `dtype` (median of `count`)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size)).astype(dtype)
    product = jax.jit(jnp.matmul)
    product(a, a).block_until_ready()
    return 2 * size**3 / np.median(timed(lambda: product(a, a), count).wall) / 1e9


def bf16_comparison(shape: Shape, args) -> dict:
    """The project's drafter step with compute_dtype float32 and bfloat16 (fp32 weights, fp32 accumulation
    and softmax either way), alternating, and a square matmul's rate in each dtype: does XLA:CPU make bf16
    faster on this processor?"""
    inputs = peer_inputs(shape)
    result = {"load_before": os.getloadavg()}
    sides = {dtype: ProjectSide(shape, inputs, args.query_chunk_blocks, dtype) for dtype in ("float32", "bfloat16")}
    for side in sides.values():
        side.drafter_steps(1)
    times = rounds("bf16 vs fp32", [(dtype, side.drafter_steps) for dtype, side in sides.items()], args)
    for dtype, timings in times.items():
        result[f"{dtype}_step_s"] = timings.median()[0]
        result[f"{dtype}_matmul_gflops"] = matmul_rate(2048, getattr(jnp, dtype), args.rounds)
    result["load_after"] = os.getloadavg()
    return result


def bf16_report(name: str, result: dict) -> str:
    return "\n".join([
        f"### bf16 vs fp32 compute, shape {name}", "",
        "| compute dtype | drafter step | 2048³ matmul |", "|---|---:|---:|",
        *(f"| {dtype} | {result[f'{dtype}_step_s']:.3f} s | {result[f'{dtype}_matmul_gflops']:.0f} GFLOP/s |"
          for dtype in ("float32", "bfloat16")), "",
        f"Load average before {fmt_load(result['load_before'])}, after {fmt_load(result['load_after'])}."])


def report(name: str, result: dict) -> str:
    shape = result["shape"]

    def seconds(key: str) -> str:  # "wall s (CPU)" of a `<name>_s` figure with its `<name>_cpu_s`
        return f"{result[key]:.3f} s ({result[key[:-2] + '_cpu_s']:.3f})" if key in result else "n/a"

    lines = [f"### shape {name}: {shape['rows']} x {shape['seq_len']:,} tokens, H {shape['hidden']}, "
             f"{shape['layers']} layers, {shape['q_heads']}/{shape['kv_heads']} heads x {shape['head_dim']}, "
             f"I {shape['intermediate']}, V {shape['vocab']:,}, {shape['seq_len'] // shape['stride']} anchors, "
             f"B {shape['block']}, {shape['features']} feature layers",
             "", "Median step, wall clock (CPU time of all threads):", "",
             "| speculators | dflash_jax drafter step | ratio (CPU-time ratio) | dflash_jax whole step |",
             "|---:|---:|---:|---:|",
             f"| {seconds('speculators_s')} | {seconds('dflash_jax_s')} | "
             + (f"{result['ratio']:.2f}x ({result['cpu_ratio']:.2f}x)" if "ratio" in result else "n/a")
             + f" | {seconds('whole_step_s')} |", "",
             f"Sides: {result['sides']}. Attention: speculators {result.get('speculators_attention', 'n/a')}; "
             f"dflash_jax {result['dflash_jax_attention']}. Load average (1/5/15 min) before "
             f"{fmt_load(result['load_before'])}, after {fmt_load(result['load_after'])}.",
             "", "Spread of the per-round medians (wall): " + ", ".join(
                 f"{side} {low:.3f}-{high:.3f} s" for side in ("speculators", "dflash_jax")
                 if (spread := result.get(f"{side}_spread_s")) for low, high in [spread]) + ".",
             "", f"Machine: {result['machine']}."]
    if "parts" in result:
        lines += ["", "| dflash_jax part (jitted alone; forward + backward where trained) | wall | CPU |",
                  "|---|---:|---:|"]
        lines += [f"| {part} | {wall:.3f} s | {cpu:.3f} s |" for part, (wall, cpu) in result["parts"].items()]
    return "\n".join(lines)


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (Linux), else unbounded."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(args) -> str:
    """What every figure depends on besides the code: the CPU, its cores, and each side's thread settings."""
    threads = {name: os.environ[name] for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "XLA_FLAGS")
               if name in os.environ}
    return (f"CPU {cpu_model()}, {os.cpu_count()} cores; speculators: torch threads {args.threads}; dflash_jax: "
            f"XLA:CPU's own pool over all cores; environment {threads or 'no thread variables'}")


def fmt_load(load) -> str:
    return " / ".join(f"{x:.1f}" for x in load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="A,B,qwen3_8b", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (XLA uses all cores)")
    parser.add_argument("--query-chunk-blocks", type=int, default=base_config().query_chunk_blocks)
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    parser.add_argument("--bf16-shapes", default="A", help="shapes whose drafter step is also timed in bf16")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not SPECULATORS_PYTHON.exists():
        sys.exit("error: .venv-speculators is missing; `make bench-peer` builds it (make venv-speculators)")
    names = [name for name in args.shapes.split(",") if name]
    bf16_names = [name for name in args.bf16_shapes.split(",") if name]
    unknown = sorted(set(names + bf16_names) - set(SHAPES))
    if unknown:
        sys.exit(f"error: unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    print(f"jax {jax.__version__}; {machine_line(args)}; {args.rounds} rounds x {args.steps} steps per side",
          flush=True)
    results = {}
    for name in names:
        needed, available = SHAPES[name].memory_estimate(), available_memory()
        if needed / 2 > available:
            print(f"shape {name}: skipped, one side needs about {needed / 2**31:.1f} GiB and "
                  f"{available / 2**30:.1f} GiB are available\n", flush=True)
            continue
        if needed > available:
            print(f"shape {name}: the two sides need about {needed / 2**30:.1f} GiB together and "
                  f"{available / 2**30:.1f} GiB are available: they run one after the other (not alternating, so "
                  f"a change of machine load between them is not cancelled)", flush=True)
        results[name] = compare(name, SHAPES[name], args, together=needed <= available)
        print(report(name, results[name]) + "\n", flush=True)
    for name in bf16_names:
        results[f"{name} bf16"] = bf16_comparison(SHAPES[name], args)
        print(bf16_report(name, results[f"{name} bf16"]) + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
