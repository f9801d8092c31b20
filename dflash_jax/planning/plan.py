r"""Plan a training run ahead of time: the whole train step compiled with abstract arrays (shapes, dtypes and
shardings; no weight is read), its memory per device, and its step time predicted from what the compiled step
asks of each resource (design §13):

    dflash-jax plan --config configs/qwen27b.py --topology v5p-64 [--mesh data=1,fsdp=32,tensor=1] [--hbm_gib 95]
    dflash-jax plan --config configs/qwen27b.py --topology gpu:H200x8x4 --compare [--layouts fsdp,tensor]

The command is commands/plan.py; `python -m dflash_jax.plan` is the same command. --topology names a Cloud TPU slice (v5p-64, v6e-64, or
libtpu's own v5p:2x4x4), compiled by libtpu without any TPU attached (`pip install 'dflash-jax[tpu]'`), a GPU
cluster gpu:<chip>x<GPUs per host>x<hosts> (gpu:H200x8x4; compiled by XLA's GPU compiler without any GPU attached
where the CUDA plugin is installed, gpu_topology.py, else for that many simulated CPU devices, hosts being
consecutive blocks of them), or cpu:N for N simulated CPU devices; without it, the devices this host has.
The roofline (roofline.py) divides the step's FLOPs, HBM bytes and collective bytes on each link (read from the
compiled HLO with loop bodies times their trip counts: hlo_cost.py) by the chip's published peaks (chips.py).
The target's architecture is read from config.target_dir's config.json (no weights), or, without a
target_dir, from the config file's `target_config()` (configs/qwen27b.py). Over the budget (--hbm_gib,
default the device kind's memory) it fails naming the step's largest arrays. `dflash-jax train` runs the same
check before loading any weights when the devices report their memory (or config.hbm_gib gives it).
"""

from __future__ import annotations

import importlib.util
import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict

from dflash_jax.planning.chips import CHIPS, Chip, chip_named, chip_of_kind
from dflash_jax.planning.gpu_topology import gpu_topology_devices
from dflash_jax.runtime.errors import ConfigError, UserError
from dflash_jax.planning.hlo_cost import HloCost, LargeArray, hlo_cost
from dflash_jax.ops.backends import resolve_attention_impl
from dflash_jax.planning.roofline import Roofline, format_roofline, roofline
from dflash_jax.sharding import TARGET_LAYOUTS, auto_target_layout, state_shardings, token_sharding
from dflash_jax.train import epochs, flops, validate
from dflash_jax.train.state import state_spec
from dflash_jax.train.step import BATCH_KEYS, abstract_schedule_length, make_step
from dflash_jax.weights.families import family_of, resolve
from dflash_jax.weights.hub import local_dir
from dflash_jax.weights.safetensors_dir import read_config

GIB = 2**30

class Plan(NamedTuple):
    """One compiled train step: bytes and FLOPs are per device unless named otherwise."""

    backend: str  # what compiled it: "TPU v5p (deviceless, 32 chips)", "cpu (8 devices)", ...
    device_kind: str
    mesh: dict[str, int]
    rows_per_device: float  # rows of the global batch per (data, fsdp) shard, which `tensor` devices share
    target_layout: str  # config.target_layout ("auto" settled: sharding.auto_target_layout)
    target_bytes: int  # the frozen target's weights
    target_bytes_by_layout: dict[str, int]  # what they would take in each layout (dflash_jax/sharding.py)
    params_bytes: int  # the drafter's fp32 weights
    opt_state_bytes: int
    batch_bytes: int
    argument_bytes: int  # the step's inputs as the compiler holds them (state, target, batch)
    temp_bytes: int  # the compiler's temporaries (activations, gathered weights, gradients)
    code_bytes: int  # generated code
    total_bytes: int  # what the step needs resident: arguments, outputs not aliased to them, temporaries, code
    xla_flops: float  # the compiler's cost analysis for one device (loop bodies once)
    model_flops: float  # train/flops.py's count for the whole step, all devices
    cost: HloCost  # read from the compiled HLO for one device, loop bodies times their trip counts
    roofline: Roofline | None  # the predicted step time, where the chip's peaks are known (chips.py)
    largest: tuple[LargeArray, ...]  # the biggest arrays the program holds, largest first
    hbm_bytes: int | None  # the budget, if known
    # The compiled step itself (jax.stages.Compiled): a run that planned its step calls this executable instead of
    # compiling the step again (train/startup.py).
    executable: Any = None


def slice_topology(name: str) -> str:
    """A Cloud TPU slice name (v5p-64, tpu7x-64: 64 TensorCores = 32 chips for v4, v5p and TPU7x; v6e-64, v5e-16:
    chips) as libtpu's topology (v5p:2x4x4, tpu7x:2x4x4, v6e:8x8); a name already in libtpu's form is returned as
    it is."""
    match = re.fullmatch(r"(v4|v5p|v5e|v6e|tpu7x)-(\d+)", name)
    if match is None:
        return name
    generation, count = match.group(1), int(match.group(2))
    three_d = generation in ("v4", "v5p", "tpu7x")
    chips = count // 2 if three_d else count
    dims = [1, 1, 1] if three_d else [1, 1]
    while math.prod(dims) < chips:  # the standard slice shapes: double the smallest axis, the last one first
        smallest = min(dims)
        dims[len(dims) - 1 - dims[::-1].index(smallest)] *= 2
    if math.prod(dims) != chips:
        raise UserError(f"--topology {name}: {chips} chips is not a power-of-two slice; give libtpu's form, e.g. "
                        f"{generation}:2x2x2")
    # libtpu's names put the axes ascending, a 3D slice's unit axis last (v5p-8: 2x2x1, v5p-16: 2x2x2).
    dims = sorted(dims, key=lambda size: (size == 1, size))
    return f"{generation}:{'x'.join(map(str, dims))}"


class GpuCluster(NamedTuple):
    chip: Chip
    per_host: int
    hosts: int


def gpu_cluster(topology: str | None) -> GpuCluster | None:
    """--topology gpu:<chip>x<GPUs per host>x<hosts> (gpu:H200x8x4), else None."""
    if topology is None or not topology.startswith("gpu:"):
        return None
    match = re.fullmatch(r"gpu:(\w+?)x(\d+)x(\d+)", topology)
    chip = chip_named(match.group(1)) if match else None
    if chip is None or chip.local_link != "nvlink":
        raise UserError(f"--topology {topology}: expected gpu:<chip>x<GPUs per host>x<hosts> with chip one of "
                        f"{', '.join(chip.name for chip in CHIPS if chip.gpu)} (e.g. gpu:H200x8x4)")
    return GpuCluster(chip, int(match.group(2)), int(match.group(3)))


def topology_devices(topology: str | None) -> list:
    """The devices to compile for (see --topology)."""
    if topology is None:
        return jax.devices()
    if (cluster := gpu_cluster(topology)) is not None:
        devices = gpu_topology_devices(cluster.chip, cluster.per_host, cluster.hosts)
        if devices is not None:
            return devices
        topology = f"cpu:{cluster.per_host * cluster.hosts}"
    if topology.startswith("cpu:"):
        count = int(topology.removeprefix("cpu:"))
        try:
            jax.config.update("jax_num_cpu_devices", count)  # only before the CPU backend starts
        except RuntimeError:
            pass
        devices = jax.devices("cpu")
        if len(devices) < count:
            raise UserError(f"--topology {topology}: this process already started JAX with {len(devices)} CPU "
                            f"devices (set XLA_FLAGS=--xla_force_host_platform_device_count={count})")
        return devices[:count]
    from jax.experimental import topologies
    try:
        return topologies.get_topology_desc(slice_topology(topology), "tpu").devices
    except Exception as error:  # libtpu missing, or a name it does not know
        raise UserError(f"--topology {topology}: cannot describe this TPU slice ({str(error).splitlines()[0]}); "
                        f"deviceless TPU plans need libtpu: pip install 'dflash-jax[tpu]'") from None


def target_architecture(config: ConfigDict, config_file: str | None = None):
    """The target's config: from config.target_dir's config.json, else the config file's target_config()."""
    if config.target_dir:
        directory = local_dir(config.target_dir, "target")
        return resolve(read_config(directory), f"{directory}/config.json")[1]
    if config_file:
        spec = importlib.util.spec_from_file_location("_plan_config", config_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if hasattr(module, "target_config"):
            return module.target_config()
    raise ConfigError("set config.target_dir (its config.json is read, no weights) or plan with a config file that "
                      "defines target_config(), such as configs/qwen27b.py")


def device_memory_gib(device) -> float | None:
    """What the runtime lets one of this process's devices allocate (TPU and GPU report it; CPU does not)."""
    stats = device.memory_stats()
    return stats["bytes_limit"] / GIB if stats and "bytes_limit" in stats else None


def target_bytes_by_layout(target_state, mesh) -> dict[str, int]:
    """What the target's weights take per device in each layout (sharding.TARGET_LAYOUTS)."""
    return {layout: per_device_bytes(_abstract(target_state, state_shardings(target_state, mesh, layout)))
            for layout in TARGET_LAYOUTS}


def per_device_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def mesh_granules(mesh, devices_per_host: int | None) -> list[int]:
    """The slice or host of each of the mesh's devices in row-major order: a simulated cluster's hosts are
    blocks of `devices_per_host` consecutive device ids; otherwise a TPU's slice, else its process."""
    devices = list(mesh.devices.flat)
    if devices_per_host:
        return [device.id // devices_per_host for device in devices]
    return [granule_of(device) for device in devices]


def granule_of(device) -> int:
    """A TPU's slice (ICI joins every host of a slice; a deviceless topology's devices carry no slice index and
    form one slice), else the device's process (its host)."""
    if device.platform == "tpu":
        return getattr(device, "slice_index", 0)
    return device.process_index


def abstract_config(config: ConfigDict) -> ConfigDict:
    """A copy of `config` to plan with: no tokenizer is read, and the mask token's id (0 when not given) changes
    no shape."""
    config = ConfigDict(config.to_dict())
    if config.drafter.mask_token_id is None:
        config.drafter.mask_token_id = 0
    return config


def plan_train_step(config: ConfigDict, target_config, mesh, hbm_gib: float | None = None, chip: Chip | None = None,
                    devices_per_host: int | None = None, epoch_tokens: int | None = None) -> Plan:
    """Compile the train step of `config` for `mesh` from abstract arrays and measure it (see `Plan`). chip: the
    accelerator the roofline uses (default: the devices' kind); devices_per_host: for GPU clusters simulated on
    CPU devices (a deviceless GPU topology's devices carry their host);
    epoch_tokens: the corpus's tokens an epoch, which give config.epochs its steps (train/epochs.py)."""
    platform = mesh.devices.flat[0].platform
    attention_impl = resolve_attention_impl(config.attention_impl, platform)
    config = abstract_config(config)  # the batch and the layout are settled below
    validate.settle_batch_size(config, mesh.shape["data"] * mesh.shape["fsdp"])  # rows_per_device
    validate.validate_target_layout(config)
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer=None)
    target = family_of(target_config).abstract_model(target_config, param_dtype=validate.dtype_of(config.target_dtype),
                                   attention_impl=attention_impl, mesh=mesh,
                                   delta_rule_dtype=config.target_matmul_dtype)
    target_graphdef, target_state = nnx.split(target)
    by_layout = target_bytes_by_layout(target_state, mesh)
    kind = mesh.devices.flat[0].device_kind
    chip = chip or chip_of_kind(kind)
    if hbm_gib is None and chip is not None:
        hbm_gib = chip.hbm_bytes / GIB
    if config.target_layout == "auto":
        config.target_layout = auto_target_layout(by_layout, None if hbm_gib is None else hbm_gib * GIB)
    target_shardings = state_shardings(target_state, mesh, config.target_layout)
    spec = state_spec(drafter_config, config, attention_impl, mesh)
    step = make_step(config, drafter_config, spec, target_graphdef, target_shardings, mesh)
    shape = (config.data.batch_size, config.data.seq_len)
    batch = {key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=token_sharding(mesh)) for key in BATCH_KEYS}
    target_abstract = _abstract(target_state, target_shardings)
    lowered = step.train_step.lower(spec.abstract, target_abstract, batch, abstract_schedule_length(mesh))
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:  # the TPU compiler refuses a program larger than a device's HBM
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise ConfigError(f"the train step does not fit a device ({kind}) on mesh {dict(mesh.shape)}, "
                          f"{config.target_layout} layout: the compiler says "
                          f"{str(error).split('RESOURCE_EXHAUSTED: ', 1)[-1].splitlines()[0]}") from None

    memory = compiled.memory_analysis()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
             + memory.temp_size_in_bytes + memory.generated_code_size_in_bytes)
    hlo = compiled.as_text()
    granules = mesh_granules(mesh, devices_per_host)
    cost = hlo_cost(hlo, dict(mesh.shape), granules.__getitem__)
    model_flops = flops.train_step_flops(config, target_config, drafter_config)
    tokens = config.data.batch_size * config.data.seq_len
    steps = config.total_steps
    if steps is None and config.epochs and epoch_tokens:
        steps = epochs.steps_for_epochs(config.epochs, epoch_tokens, epochs.tokens_per_step(config))
    line = None if chip is None else roofline(cost, model_flops / mesh.size, chip, tokens, steps)
    deviceless = " deviceless" if platform != jax.default_backend() else ""
    hosts = len(set(granules))
    backend = f"{platform}{deviceless} compiler, {mesh.size} x {kind}"
    if devices_per_host:
        backend += f" for {chip.name} ({hosts} hosts of {devices_per_host})"
    elif platform == "gpu" and hosts > 1:
        backend += f" ({hosts} hosts of {mesh.size // hosts})"
    return Plan(
        backend=backend, device_kind=kind, mesh=dict(mesh.shape),
        rows_per_device=config.data.batch_size / (mesh.shape["data"] * mesh.shape["fsdp"]),
        target_layout=config.target_layout, target_bytes=by_layout[config.target_layout],
        target_bytes_by_layout=by_layout, params_bytes=per_device_bytes(spec.abstract.params),
        opt_state_bytes=per_device_bytes(spec.abstract.opt_state), batch_bytes=per_device_bytes(batch),
        argument_bytes=memory.argument_size_in_bytes, temp_bytes=memory.temp_size_in_bytes, code_bytes=memory.generated_code_size_in_bytes, total_bytes=total,
        xla_flops=float(analysis.get("flops", 0.0)) if analysis else 0.0, model_flops=model_flops, cost=cost,
        roofline=line, largest=cost.largest,
        hbm_bytes=None if hbm_gib is None else int(hbm_gib * GIB), executable=compiled)


def _size(n: float) -> str:
    return f"{n / GIB:8.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:8.2f} MiB"


def format_plan(plan: Plan) -> str:
    devices = math.prod(plan.mesh.values())
    lines = [
        f"train step on {plan.backend}; mesh {plan.mesh}, {plan.rows_per_device:g} rows per (data, fsdp) shard "
        f"of {plan.mesh['tensor']} device(s)",
        "per device:",
        f"  target weights     {_size(plan.target_bytes)}  ({plan.target_layout} layout; "
        + ", ".join(f"{layout}: {_size(size).strip()}" for layout, size in plan.target_bytes_by_layout.items()
                    if layout != plan.target_layout) + ")",
        f"  drafter parameters {_size(plan.params_bytes)}",
        f"  optimizer state    {_size(plan.opt_state_bytes)}",
        f"  batch              {_size(plan.batch_bytes)}",
        f"  temporaries        {_size(plan.temp_bytes)}",
        f"  generated code     {_size(plan.code_bytes)}",
        f"  total              {_size(plan.total_bytes)}"
        + ("" if plan.hbm_bytes is None else f"  of {plan.hbm_bytes / GIB:.1f} GiB HBM"),
        f"FLOPs per step: {plan.model_flops:.4g} (model count, all devices; {plan.model_flops / devices:.4g} per "
        f"device); the compiler's per device, matmuls with loop bodies times their trip counts: "
        f"{plan.cost.flops:.4g} (its cost analysis, loop bodies once and kernels not at all: {plan.xla_flops:.4g})",
    ]
    if plan.roofline is not None:
        lines.extend(format_roofline(plan.roofline, plan.cost))
    lines.append("largest arrays:")
    lines.extend(f"  {_size(array.bytes)} {array.text}" for array in plan.largest)
    return "\n".join(lines)


def check_budget(plan: Plan) -> None:
    """UserError when the step needs more than the budget per device, naming its largest arrays."""
    if plan.hbm_bytes is not None and plan.total_bytes > plan.hbm_bytes:
        largest = ", ".join(f"{array.text} {_size(array.bytes).strip()}" for array in plan.largest[:3])
        raise UserError(f"the train step needs {plan.total_bytes / GIB:.2f} GiB per device (temporaries "
                        f"{plan.temp_bytes / GIB:.2f} GiB), over the {plan.hbm_bytes / GIB:.1f} GiB budget; largest "
                        f"arrays: {largest}. Use more devices (mesh.fsdp), fewer rows per device "
                        f"(data.batch_size, grad_accum_steps), or config.remat")
