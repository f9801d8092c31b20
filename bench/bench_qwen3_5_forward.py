"""Forward tokens/s of a tiny Qwen3.5 hybrid target on CPU: this port (jitted) next to transformers' torch
fallback (`Qwen3_5ForCausalLM`, chunked gated delta rule in PyTorch), same weights, same input, fp32.

    .venv/bin/python -m bench.bench_qwen3_5_forward [--batch 4] [--length 512] [--runs 7]

Both sides compute logits for every token. Each figure is the median of --runs timed runs after warm-up
(the JAX warm-up includes compilation). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from dflash_jax.weights.targets import load_target

# Two periods of [GDN, GDN, GDN, gated attention], value/key head ratio 3 as in the 27B.
TINY_TEXT_CONFIG = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def median_seconds(run, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    hf_model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY_TEXT_CONFIG)).eval()
    with tempfile.TemporaryDirectory() as directory:
        hf_model.save_pretrained(directory)
        model, config = load_target(directory, param_dtype=jnp.float32)

    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.length))
    positions = np.broadcast_to(np.arange(args.length), ids.shape)
    segments = np.zeros_like(ids)

    @nnx.jit
    def jax_logits(model, ids, positions, segments):
        return model.logits(model(ids, positions, segments).hidden)

    torch_ids = torch.as_tensor(ids)

    def torch_logits():
        with torch.no_grad():
            return hf_model(input_ids=torch_ids, use_cache=False).logits

    jax_run = lambda: jax.block_until_ready(jax_logits(model, ids, positions, segments))
    jax_run(), jax_run()  # compile, then one warm run
    torch_logits()
    difference = float(np.max(np.abs(np.asarray(jax_run()) - torch_logits().numpy())))

    tokens = args.batch * args.length
    jax_rate = tokens / median_seconds(jax_run, args.runs)
    torch_rate = tokens / median_seconds(torch_logits, args.runs)
    print(f"tiny Qwen3.5 hybrid target: L={config.num_hidden_layers} ({'/'.join(config.layer_period())} x"
          f"{config.num_hidden_layers // len(config.layer_period())}), H={config.hidden_size}, "
          f"V={config.vocab_size}; batch {args.batch} x {args.length} tokens, fp32, median of {args.runs} runs; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), {platform.processor() or platform.machine()}; "
          f"max |logits difference| {difference:.1e}")
    print()
    print("| implementation | tokens/s |")
    print("|---|---:|")
    print(f"| dflash_jax `Qwen3_5` (jit) | {jax_rate:,.0f} |")
    print(f"| transformers `Qwen3_5ForCausalLM` (torch fallback) | {torch_rate:,.0f} |")
    print(f"| ratio jax / torch | {jax_rate / torch_rate:.2f}x |")


if __name__ == "__main__":
    main()
