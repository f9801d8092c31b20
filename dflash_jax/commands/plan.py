r"""Plan a training run ahead of time (the library is planning/plan.py; design §13):

    dflash-jax plan --config configs/qwen27b.py --topology v5p-64 [--mesh data=1,fsdp=32,tensor=1,context=1] [--hbm_gib 95]
    dflash-jax plan --config configs/qwen27b.py --topology gpu:H200x8x4 --compare [--layouts fsdp,tensor] [--json F]

`python -m dflash_jax.plan` is the same command. Its figures are predictions.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from dflash_jax.commands import cli
from dflash_jax.planning import analytic, compare as plan_compare
from dflash_jax.planning import report
from dflash_jax.planning.chips import chip_of_kind
from dflash_jax.planning.plan import (GIB, check_budget, format_plan, gpu_cluster, granule_of, plan_train_step,
                                      target_architecture, topology_devices)
from dflash_jax.runtime.errors import UserError
from dflash_jax.sharding import TARGET_LAYOUTS
from dflash_jax.train import validate

FLAGS = flags.FlagValues()  # this command's own flags (cli.py)
_CONFIG = cli.define_config_flag(FLAGS)
_TOPOLOGY = flags.DEFINE_string("topology", None, "A TPU slice (v5p-64, v6e-64, v5p:2x4x4; needs libtpu), a GPU "
                                "cluster gpu:H200x8x4 (chip x GPUs per host x hosts; XLA's GPU compiler where the "
                                "CUDA plugin is installed, else simulated CPU devices) or cpu:N (N simulated CPU "
                                "devices); default: this host's devices.", flag_values=FLAGS)
_MESH = flags.DEFINE_string("mesh", None, "Mesh sizes, e.g. data=1,fsdp=32,tensor=1 (default: config.mesh).",
                            flag_values=FLAGS)
_HBM_GIB = flags.DEFINE_float("hbm_gib", None, "Memory budget per device in GiB (default: config.hbm_gib, else "
                              "the device kind's HBM).", flag_values=FLAGS)
_COMPARE = flags.DEFINE_bool("compare", False, "Predict every target layout and mesh the topology allows, compile "
                             "those that could win (see --compile_within) and rank them by predicted time per "
                             "token (planning/compare.py).", flag_values=FLAGS)
_COMPILE_WITHIN = flags.DEFINE_float("compile_within", analytic.COMPILE_MARGIN, "--compare: compile the candidates "
                                     "predicted to fit whose analytical time per token is within this factor of the "
                                     "best's; with --layouts or --tensor_sizes given, every candidate they name.",
                                     flag_values=FLAGS)
_LAYOUTS = flags.DEFINE_string("layouts", ",".join(TARGET_LAYOUTS), "--compare: the target layouts to try.",
                               flag_values=FLAGS)
_EPOCH_TOKENS = flags.DEFINE_float("epoch_tokens", None, "The corpus's tokens an epoch (train logs them at its "
                                   "first start), for the run time of config.epochs; without it, the time per "
                                   "billion tokens.", flag_values=FLAGS)
_TENSOR_SIZES = flags.DEFINE_string("tensor_sizes", "1,2,4,8", "--compare: the mesh.tensor sizes to try.",
                                    flag_values=FLAGS)
_CONTEXT_SIZES = flags.DEFINE_string("context_sizes", None, "--compare: the mesh.context sizes to try (a row's "
                                     "tokens split over that many devices; default: the powers of two that leave "
                                     "each shard at least 4096 tokens).", flag_values=FLAGS)
_JSON = flags.DEFINE_string("json", None, "Also write every figure of the plan (or, with --compare, of every "
                            "candidate) to this JSON file (planning/report.py).", flag_values=FLAGS)
flags.mark_flags_as_required(["config"], flag_values=FLAGS)


def _mesh_sizes(text: str) -> dict[str, int]:
    try:
        sizes = {key.strip(): int(value) for key, value in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise UserError(f"--mesh {text!r}: expected data=D,fsdp=F,tensor=T (and context=C)") from None
    unknown = set(sizes) - {"data", "fsdp", "tensor", "context", "dcn_data"}
    if unknown:
        raise UserError(f"--mesh {text!r}: unknown axes {sorted(unknown)}; the axes are data, fsdp, tensor, "
                        f"context (a row's tokens) and dcn_data (the slices or hosts the data axis also spans)")
    return sizes


def main() -> None:
    config = _CONFIG.value
    if _MESH.value:
        config.mesh.update(_mesh_sizes(_MESH.value))
    target_config = target_architecture(config, config_flags.get_config_filename(FLAGS["config"]))
    devices = topology_devices(_TOPOLOGY.value)
    cluster = gpu_cluster(_TOPOLOGY.value)
    chip = cluster.chip if cluster else None
    per_host = cluster.per_host if cluster and devices[0].platform == "cpu" else None  # simulated hosts
    epoch_tokens = None if _EPOCH_TOKENS.value is None else int(_EPOCH_TOKENS.value)
    if _COMPARE.value:
        granules = cluster.hosts if cluster else len({granule_of(d) for d in devices})
        named = FLAGS["layouts"].present or FLAGS["tensor_sizes"].present or FLAGS["context_sizes"].present
        context_sizes = plan_compare.parse_sizes(_CONTEXT_SIZES.value) if _CONTEXT_SIZES.value else None
        candidates = plan_compare.compare_plans(
            config, target_config, devices, granules, plan_compare.check_layouts(_LAYOUTS.value),
            plan_compare.parse_sizes(_TENSOR_SIZES.value), _HBM_GIB.value or config.hbm_gib, chip, per_host,
            epoch_tokens, margin=None if named else _COMPILE_WITHIN.value, context_sizes=context_sizes)
        print(plan_compare.format_comparison(candidates))
        if _JSON.value:
            report.write_json(_JSON.value, report.comparison_record(candidates))
        return
    chip = chip or chip_of_kind(devices[0].device_kind)
    budget = _HBM_GIB.value or config.hbm_gib or (chip.hbm_bytes / GIB if chip else None)
    if not _MESH.value and chip is not None and len(devices) > 1 and plan_compare.chooses_mesh(config):
        # As `train` settles a mesh left at its defaults (design §13.1): the best predicted candidate, compiled.
        config, plan, choice = plan_compare.choose_mesh(config, target_config, devices, budget, chip)
        print(f"config.mesh left at its defaults: {choice}")
    else:
        mesh = validate.mesh_from_config(config, devices)
        plan = plan_train_step(config, target_config, mesh, budget, chip, per_host, epoch_tokens)
    print(format_plan(plan))
    if _JSON.value:  # written before the budget check: a plan over its budget is the one to read
        report.write_json(_JSON.value, report.plan_record(plan))
    check_budget(plan)


if __name__ == "__main__":
    cli.run(main, FLAGS)
