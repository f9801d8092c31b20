"""Convert a Hugging Face target checkpoint (Qwen3, Qwen3.5/3.6) into an Orbax/tensorstore target directory.

    python convert/hf_to_orbax.py --hf-dir /ckpt/Qwen3.6-27B --out /ckpt/Qwen3.6-27B-orbax [--dtype bfloat16]

The result loads wherever a target directory is accepted (`load_target`, `config.target_dir`), restored
onto the training mesh shard by shard. Weights stream one NNX variable at a time (peak host memory about
one stacked weight, e.g. all layers' up_proj); config.json and the tokenizer files are copied alongside.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

import jax.numpy as jnp  # noqa: E402

from dflash_jax.errors import CheckpointError  # noqa: E402
from dflash_jax.weights.orbax_target import write_orbax_target  # noqa: E402

DTYPES = ("bfloat16", "float32", "float16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", type=Path, required=True, help="HF checkpoint: config.json + safetensors")
    parser.add_argument("--out", type=Path, required=True, help="output directory (must be empty or absent)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="storage dtype of the weights")
    parser.add_argument("--overwrite", action="store_true", help="delete a non-empty --out first")
    args = parser.parse_args(argv)
    try:
        out = write_orbax_target(args.hf_dir, args.out, dtype=jnp.dtype(args.dtype), overwrite=args.overwrite)
    except (CheckpointError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote the Orbax target {out} ({args.dtype}); use it as --config.target_dir={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
