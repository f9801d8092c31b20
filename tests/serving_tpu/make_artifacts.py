"""Step 1 of `make test-vllm-tpu` (project venv): drafter exports of the toy target and the project's draft
logits of them, for check_vllm_tpu.py.

  full     configs/toy.py with head_dim 128 (vLLM TPU's DFlash attention has no bidirectional kernel for 64, and
           pads other sizes without its q_norm and k_norm following), trained a few steps with `dflash-jax train`
           and exported with `dflash-jax export`
  sliding  the same drafter with sliding layers only (window 8), randomly initialised and exported, to show
           what vLLM TPU makes of sliding layers
  mixed    the same with a sliding and a full layer (as the 27B recipe mixes them), randomly initialised and
           exported: vLLM TPU 0.32 refuses it (check_vllm_tpu.py)
For each but mixed: random target features of a context of CONTEXT tokens, a block at the position after it (anchor
token, then mask tokens), and the project's fp32 logits of the drafted slots from the exported (bf16) weights
and the target's embedding and LM head (OUT/<name>_reference.npz); for the sliding drafter also those of the
same weights with every layer full attention. OUT/artifacts.json names the target, the exports and the printed
`dflash-jax export` lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOY_TARGET = REPO / "dflash_jax/assets/toy_target"
CONTEXT, WINDOW, TRAIN_STEPS = 24, 8, 2


def train_and_export(out: Path) -> tuple[Path, dict, str]:
    """The full drafter through the command line, as a user makes one; returns (export, the trained
    drafter_config.json, what export printed)."""
    workdir, export_dir = out / "run", out / "drafter_full"
    overrides = {"drafter.head_dim": 128, "total_steps": TRAIN_STEPS, "checkpoint_every": TRAIN_STEPS,
                 "eval_every": 0, "mesh.fsdp": 1}
    subprocess.run([sys.executable, "-m", "dflash_jax.train", "--config", str(REPO / "configs/toy.py"),
                    "--workdir", str(workdir), *(f"--config.{key}={value}" for key, value in overrides.items())],
                   check=True, cwd=REPO)
    printed = subprocess.run([sys.executable, "-m", "dflash_jax.export", "--workdir", str(workdir), "--out",
                              str(export_dir), "--overwrite"], check=True, cwd=REPO, capture_output=True,
                             text=True).stdout
    return export_dir, json.loads((workdir / "drafter_config.json").read_text()), printed


def export_untrained(trained: dict, layer_types: tuple[str, ...], name: str, out: Path) -> tuple[Path, dict]:
    """(export, its drafter config): the trained config with these layer types (window WINDOW), random weights."""
    from flax import nnx

    from dflash_jax.models.drafter import Drafter, DrafterConfig
    from dflash_jax.weights.drafter_files import export_drafter
    config = dataclasses.replace(DrafterConfig(**trained), layer_types=layer_types, sliding_window=WINDOW)
    export_dir = export_drafter(Drafter(config, rngs=nnx.Rngs(1)), config, out / f"drafter_{name}", overwrite=True)
    return export_dir, dataclasses.asdict(config)


def draft_logits(drafter, target, features, block_ids):
    """The project's fp32 logits [B-1, V] of the drafted slots: the block at position CONTEXT after the context
    features, through the decoding path (a cache of the context, as served)."""
    import jax.numpy as jnp

    from dflash_jax.models.drafter import DecodeStep
    hidden, _ = drafter(features[None], target.embed(block_ids[None]),
                        DecodeStep(context_start=jnp.int32(0), anchor=jnp.int32(CONTEXT)),
                        drafter.init_cache(1, CONTEXT))
    return hidden[0, 1:] @ target.lm_head_kernel()


def write_reference(export_dir: Path, target, name: str, out: Path) -> Path:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.weights.drafter_files import drafter_from_torch_layout, drafter_to_torch_layout, load_drafter_dir
    drafter, config = load_drafter_dir(export_dir)  # the bf16 weights on disk, in fp32
    keys = jax.random.split(jax.random.key(0))
    features = jax.random.normal(keys[0], (CONTEXT, len(config.target_layer_ids) * config.hidden_size))
    anchor = jax.random.randint(keys[1], (), 0, config.vocab_size)
    block_ids = jnp.full((config.block_size,), config.mask_token_id).at[0].set(anchor)
    arrays = {"features": features, "block_ids": block_ids, "logits": draft_logits(drafter, target, features,
                                                                                  block_ids)}
    if config.sliding_window is not None:
        full = dataclasses.replace(config, layer_types=("full_attention",) * config.num_hidden_layers,
                                   sliding_window=None)
        as_full = drafter_from_torch_layout(drafter_to_torch_layout(drafter), full)
        arrays["logits_all_full"] = draft_logits(as_full, target, features, block_ids)
    path = out / f"{name}_reference.npz"
    np.savez(path, **{key: np.asarray(value) for key, value in arrays.items()})
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp

    from dflash_jax.weights.targets import load_target

    full_dir, full_config, printed = train_and_export(out)
    target, _ = load_target(TOY_TARGET, param_dtype=jnp.float32)
    sliding = ("sliding_attention",) * full_config["num_hidden_layers"]
    exports = {"full": (full_dir, full_config),
               "sliding": export_untrained(full_config, sliding, "sliding", out),
               "mixed": export_untrained(full_config, ("sliding_attention", "full_attention"), "mixed", out)}
    drafters = {}
    for name, (export_dir, config) in exports.items():
        trained = {key: config[key] for key in ("block_size", "mask_token_id", "num_hidden_layers",
                                                "target_layer_ids", "layer_types", "rope_theta", "rope_scaling")}
        drafters[name] = {"dir": str(export_dir), "trained": trained}
        if name != "mixed":
            drafters[name]["reference"] = str(write_reference(export_dir, target, name, out))
    artifacts = {"target": str(TOY_TARGET), "context": CONTEXT, "drafters": drafters, "export_printed": printed}
    (out / "artifacts.json").write_text(json.dumps(artifacts, indent=2) + "\n")
    print(f"wrote {out / 'artifacts.json'}")


if __name__ == "__main__":
    main()
