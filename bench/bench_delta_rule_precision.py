"""The frozen target's Gated DeltaNet with bf16 chunk products (fp32 accumulation, fp32 state) against the fp32
path, on what training uses of the target (design §8.3): the feature layers and the greedy labels.

    python bench/bench_delta_rule_precision.py [--shape tiny|wide|both] [--length 1024] [--rows 4]

For each random hybrid target ([GDN, GDN, GDN, attention] periods, random init; "tiny" the test's widths,
"wide" 27B's Gated DeltaNet head widths on a narrow stack) and each weight dtype (float32 isolates the rule's
error; bfloat16 is what training runs), rows of random tokens packed as two documents each run through the
target built twice, `Qwen3_5(delta_rule_dtype="float32")` and `("bfloat16")`. Printed: the features' relative error
‖Δ‖/‖f‖ (every layer, and the worst layer), the greedy labels' agreement, and for scale the same two figures
between the float32 and bfloat16 weights (both with fp32 products). Random weights give near-flat logits,
where argmax flips most easily: a pessimistic agreement. Runs on CPU (bf16 dots are emulated there, so its
figures are the rounding's, not a TPU's speed); bench/RESULTS.md has the figures.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3_5, Qwen3_5Config

PERIOD = (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
SHAPES = {
    "tiny": dict(vocab_size=640, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
    "wide": dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=128, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128),
}


def random_targets(shape: str, seed: int = 0) -> dict[tuple[str, str], Qwen3_5]:
    """One random target's weights in float32 and in bfloat16 (the decay parameters stay fp32, as the model
    keeps them), each built with the delta rule's products in float32 and in bfloat16: {(weights, products)}."""
    fields = SHAPES[shape]
    config = Qwen3_5Config(**fields, layer_types=PERIOD * (fields["num_hidden_layers"] // len(PERIOD)))
    exact = nnx.state(Qwen3_5(config, param_dtype=jnp.float32, rngs=nnx.Rngs(seed)))
    targets = {}
    for weights in ("float32", "bfloat16"):
        for products in ("float32", "bfloat16"):
            graphdef, like = nnx.split(nnx.eval_shape(lambda: Qwen3_5(
                config, param_dtype=jnp.dtype(weights), rngs=nnx.Rngs(seed), delta_rule_dtype=products)))
            targets[weights, products] = nnx.merge(graphdef, jax.tree.map(lambda v, l: v.astype(l.dtype), exact,
                                                                          like))
    return targets


def packed_rows(vocab: int, rows: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random tokens, each row two documents (the second from a third of the way in), positions restarting."""
    ids = np.random.default_rng(seed).integers(0, vocab, (rows, length)).astype(np.int32)
    segments = (np.arange(length) >= length // 3).astype(np.int32)[None].repeat(rows, 0)
    positions = np.where(segments == 0, np.arange(length), np.arange(length) - length // 3).astype(np.int32)
    return ids, positions, segments


def features_and_labels(model: Qwen3_5, ids, positions, segments):
    """(features of every layer [B, T, L, H] in fp32, greedy labels [B, T])."""
    layers = tuple(range(model.config.num_hidden_layers))

    @nnx.jit
    def run(model, ids, positions, segments):
        out = model(ids, positions, segments, layers)
        return out.features.astype(jnp.float32), jnp.argmax(model.logits(out.hidden), axis=-1)

    return jax.device_get(run(model, ids, positions, segments))


def compare(reference, other) -> tuple[float, float, float]:
    """(features' relative error over all layers, the worst layer's, greedy-label agreement)."""
    (ref_features, ref_labels), (features, labels) = reference, other
    error = np.linalg.norm(features - ref_features) / np.linalg.norm(ref_features)
    per_layer = [np.linalg.norm(features[:, :, i] - ref_features[:, :, i]) / np.linalg.norm(ref_features[:, :, i])
                 for i in range(ref_features.shape[2])]
    return float(error), float(max(per_layer)), float(np.mean(labels == ref_labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=(*SHAPES, "both"), default="both")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args()
    for shape in SHAPES if args.shape == "both" else (args.shape,):
        vocab = SHAPES[shape]["vocab_size"]
        batch = packed_rows(vocab, args.rows, args.length)
        runs = {key: features_and_labels(model, *batch) for key, model in random_targets(shape).items()}
        for name in ("float32", "bfloat16"):
            error, worst, agreement = compare(runs[name, "float32"], runs[name, "bfloat16"])
            print(f"{shape} target, {name} weights, T={args.length} x {args.rows} rows: bf16 delta-rule products "
                  f"against fp32: feature rel. error {error:.2e} (worst layer {worst:.2e}), greedy labels "
                  f"{agreement:.2%} equal")
        error, worst, agreement = compare(runs["float32", "float32"], runs["bfloat16", "float32"])
        print(f"{shape} target, for scale: bf16 weights against fp32 weights (fp32 products): feature rel. error "
              f"{error:.2e} (worst layer {worst:.2e}), greedy labels {agreement:.2%} equal")


if __name__ == "__main__":
    main()
