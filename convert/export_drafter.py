"""Export a trained drafter from a training workdir in the z-lab layout vLLM serves (design §10).

    python convert/export_drafter.py --workdir /ckpt/run1 --out /ckpt/run1-dflash [--step N] [--overwrite]

Reads <workdir>/drafter_config.json and the drafter params of <workdir>/checkpoints/<step> (the latest step
unless --step), writes <out>/config.json + <out>/model.safetensors (bf16) and prints the `vllm serve` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout


from dflash_jax.errors import CheckpointError  # noqa: E402
from dflash_jax.train.checkpoint import restore_drafter, workdir_path  # noqa: E402
from dflash_jax.weights.drafter_export import check_out_dir, export_drafter, serve_command  # noqa: E402

TRAIN_CONFIG_FILE = "config.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=workdir_path, required=True,
                        help="the training run's --workdir (a local path or a bucket URI such as gs://bucket/run)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the latest)")
    parser.add_argument("--out", type=Path, required=True, help="export directory (config.json, model.safetensors)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace config.json and *.safetensors in a non-empty --out")
    args = parser.parse_args(argv)
    try:
        check_out_dir(args.out, args.overwrite)  # before the (possibly long) restore
        drafter, config, step = restore_drafter(args.workdir, args.step)
        out = export_drafter(drafter, config, args.out, overwrite=args.overwrite)
    except (CheckpointError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    train_config = args.workdir / TRAIN_CONFIG_FILE
    target = json.loads(train_config.read_text()).get("target_dir") if train_config.is_file() else None
    print(f"exported step {step} of {args.workdir} to {out}")
    print("serve it with:\n  " + serve_command(target or "TARGET", out.absolute(), config.block_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
