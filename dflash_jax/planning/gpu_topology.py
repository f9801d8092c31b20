"""GPU clusters compiled by XLA's GPU compiler without a GPU (design §13): the CUDA plugin (jax-cuda12-plugin and
jax-cuda12-pjrt, pinned by launch/constraints.txt; `make .cudaplan/.installed` puts them in .cudaplan, to be put
on PYTHONPATH) describes a topology of GPUs that are not there, and a program compiled for its devices is the
GPU program: Triton and cuBLAS matmuls, NCCL collectives, GPU buffer assignment. No driver is needed; the
compiler learns what each GPU is from the description `target_description` writes from chips.py. cuDNN
attention also needs cuDNN's library (nvidia-cudnn-cu12) to be traced, and its workspace is not counted in the
memory: sizing it takes a GPU.
"""

from __future__ import annotations

import importlib.util
import logging

import jax

from dflash_jax.planning.chips import Chip

log = logging.getLogger(__name__)

INSTALL = "make .cudaplan/.installed, then run with PYTHONPATH=.cudaplan JAX_PLATFORMS=cpu"


def target_description(chip: Chip) -> str:
    """`chip` as XLA's GPU compiler reads a GPU it does not have: a stream_executor.GpuTargetConfigProto in text
    form. A compile fails without the warp size, the grid's x limit, the shared memory a block may opt in to or
    the compute capability; the other fields steer its heuristics (tiling and fusion by SMs, clock and bandwidth,
    the scheduler's memory limit), so they are given too. The tensor cores' clock is the one at which
    `chip.bf16_flops` is reached; the per-block limits are CUDA's for every architecture since compute
    capability 3.0."""
    gpu = chip.gpu
    major, minor = gpu.compute_capability
    # Dense bf16 multiply-adds an SM's tensor cores do a clock: 1024 on Ampere, twice that on Hopper.
    fmas_per_sm_clock = 1024 if major < 9 else 2048
    clock_ghz = chip.bf16_flops / (2 * fmas_per_sm_clock * gpu.sms) / 1e9
    fields = {
        "core_count": gpu.sms,
        "fpus_per_core": gpu.fp32_units_per_sm,
        "clock_rate_ghz": round(clock_ghz, 4),
        "threads_per_core_limit": gpu.threads_per_sm,
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "registers_per_core_limit": gpu.registers_per_sm,
        "registers_per_block_limit": gpu.registers_per_sm,
        "shared_memory_per_core": gpu.shared_memory_per_sm,
        "shared_memory_per_block": 48 * 1024,  # without opting in
        "shared_memory_per_block_optin": gpu.shared_memory_per_block,
        "l2_cache_size": gpu.l2_bytes,
        "memory_bandwidth": int(chip.hbm_bandwidth),
        "device_memory_size": int(chip.hbm_bytes),
    }
    lines = [f"  {key}: {value}" for key, value in fields.items()]
    lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
    return "gpu_device_info {\n" + "\n".join(lines) + f'\n}}\ndevice_description_str: "NVIDIA {chip.name}"\n'


def gpu_topology_devices(chip: Chip, per_host: int, hosts: int) -> list | None:
    """The devices of `hosts` hosts of `per_host` GPUs each (a device's process_index is its host) for XLA's GPU
    compiler, or None, logged, where the CUDA plugin is missing or cannot describe them."""
    if chip.gpu is None or importlib.util.find_spec("jax_cuda12_plugin") is None:
        reason = f"no description of {chip.name} for the compiler (chips.py)" if chip.gpu is None else \
            "the CUDA plugin (jax-cuda12-plugin) is not importable"
        log.warning("%s: planning on %d simulated XLA:CPU devices instead, whose memory is XLA:CPU's (it computes "
                    "bf16 matmuls in fp32 copies); for the GPU compiler: %s", reason, per_host * hosts, INSTALL)
        return None
    # Without a driver the plugin's CUDA backend fails to start and takes the plugin's topologies with it; the
    # compiler needs no backend, so only the CPU one is started (a no-op once JAX's backends run).
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(chip.name.lower(), "cuda", topology=f"1x{hosts}x{per_host}",
                                                target_config=target_description(chip))
    except (NotImplementedError, RuntimeError) as error:
        log.warning("the CUDA plugin cannot describe %d x %s (%s): planning on simulated XLA:CPU devices instead; "
                    "for the GPU compiler: %s", per_host * hosts, chip.name, str(error).splitlines()[0], INSTALL)
        return None
    return topology.devices
