"""Export a trained drafter from a training workdir in the z-lab layout vLLM serves (design §10).

    python convert/export_drafter.py --workdir /ckpt/run1 --out /ckpt/run1-dflash [--step N] [--overwrite] \
        [--push-to-hub OWNER/NAME]

Reads <workdir>/drafter_config.json and the drafter params of <workdir>/checkpoints/<step> (the latest step
unless --step), writes <out>/config.json + <out>/model.safetensors (bf16) and a model card <out>/README.md
(target, data, steps, block size, feature layers, the last exact/DDTree τ, the vLLM and SGLang commands),
prints the `vllm serve` line, and with --push-to-hub uploads <out> to that Hub repo.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout


from dflash_jax.errors import CheckpointError  # noqa: E402
from dflash_jax.train.checkpoint import restore_drafter, workdir_path  # noqa: E402
from dflash_jax.weights.drafter_export import check_out_dir, export_drafter, serve_command  # noqa: E402
from dflash_jax.weights.model_card import CARD_FILE, push_to_hub, training_facts, write_model_card  # noqa: E402



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=workdir_path, required=True,
                        help="the training run's --workdir (a local path or a bucket URI such as gs://bucket/run)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the latest)")
    parser.add_argument("--out", type=Path, required=True, help="export directory (config.json, model.safetensors)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace config.json and *.safetensors in a non-empty --out")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None,
                        help="then upload --out to this Hugging Face Hub model repo (owner/name; needs hf auth login)")
    args = parser.parse_args(argv)
    try:
        check_out_dir(args.out, args.overwrite)  # before the (possibly long) restore
        drafter, config, step = restore_drafter(args.workdir, args.step)
        out = export_drafter(drafter, config, args.out, overwrite=args.overwrite)
    except (CheckpointError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    facts = training_facts(args.workdir, step)
    write_model_card(out, config, facts, drafter=args.push_to_hub or str(out.absolute()))
    print(f"exported step {step} of {args.workdir} to {out} (model card: {out / CARD_FILE})")
    print("serve it with:\n  " + serve_command(facts.target, out.absolute(), config.block_size))
    if args.push_to_hub:
        try:
            print(f"uploaded to {push_to_hub(out, args.push_to_hub)}")
        except CheckpointError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
