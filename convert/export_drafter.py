"""Export a trained drafter from a training workdir in the z-lab layout vLLM serves (SPEC §10).

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

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from dflash_jax.models.drafter import Drafter, DrafterConfig  # noqa: E402
from dflash_jax.weights.drafter_export import check_out_dir, export_drafter, serve_command  # noqa: E402
from dflash_jax.weights.safetensors_dir import CheckpointError  # noqa: E402

DRAFTER_CONFIG_FILE, CHECKPOINTS_DIR, TRAIN_CONFIG_FILE = "drafter_config.json", "checkpoints", "config.json"


def restore_drafter(workdir: Path, step: int | None) -> tuple[Drafter, DrafterConfig, int]:
    """The fp32 drafter saved at `step` (None: the latest) of a `python -m dflash_jax.train` workdir."""
    config_path = workdir / DRAFTER_CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found; is {workdir} a training workdir?")
    config = DrafterConfig(**json.loads(config_path.read_text()))
    manager = ocp.CheckpointManager(workdir.absolute() / CHECKPOINTS_DIR, item_names=("state", "data"),
                                    options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointError(f"{workdir / CHECKPOINTS_DIR}: no checkpoint found")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{workdir / CHECKPOINTS_DIR}: no checkpoint at step {step}; available steps: "
                              f"{', '.join(map(str, steps))}")

    # Restore only TrainState.params (not the optimizer state) onto the host CPU. The state was saved as a
    # pytree of nnx Variables, whose leaves sit under a final "value" key.
    abstract = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    variables = [(tuple(map(str, path)), variable) for path, variable in nnx.to_flat_state(params)]
    target: dict = {}
    for path, variable in variables:
        _nested(target, path)["value"] = jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=cpu)
    item = {"params": target}
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
    for path, variable in variables:
        variable.set_value(_nested(restored.state["params"], path)["value"])
    return nnx.merge(graphdef, params, rest), config, step


def _nested(tree: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        tree = tree.setdefault(key, {})
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="the training run's --workdir")
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
