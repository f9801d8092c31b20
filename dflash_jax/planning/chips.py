"""Published peaks of the accelerators a plan is made for (design §13): what the roofline divides by.

Link bandwidths are what one device can send at once in a collective, derived from the published figures:
- TPU ICI: a ring over one torus axis uses that axis's two ports, each carrying bidirectional-per-chip / ports
  of which half leaves the chip, so a device sends bidirectional / ports (a collective spanning several torus
  axes may do better; the plan assumes one).
- TPU DCN: the host's NICs shared by its chips.
- NVLink: half the bidirectional per-GPU figure (NVSwitch connects every pair of GPUs of a host, or of a GB200
  NVL72 rack's 72, at it).
- GPU network: one NIC per GPU (400 Gb/s ConnectX-7 in DGX/HGX H100, H200 and B200 systems and GB200 NVL72,
  800 Gb/s ConnectX-8 in HGX B300, 200 Gb/s in DGX A100).

A GPU's `GpuSpec` is what XLA's GPU compiler is told of it to compile for it without one (planning/gpu_topology.py):
its streaming multiprocessors (SMs) and their limits, from NVIDIA's architecture whitepapers and the CUDA
programming guide's table of compute capabilities.
"""

from __future__ import annotations

from typing import NamedTuple

GB = 1e9
KIB, MIB = 2**10, 2**20


class GpuSpec(NamedTuple):
    compute_capability: tuple[int, int]
    sms: int
    l2_bytes: int
    shared_memory_per_sm: int  # bytes
    shared_memory_per_block: int  # bytes, the most one block may opt in to
    registers_per_sm: int  # 32-bit registers, which one block may also use all of
    threads_per_sm: int
    fp32_units_per_sm: int


# Hopper (H100 and H200, compute capability 9.0): 132 SMs in the SXM parts, each with 228 KB of shared memory
# (227 KB for one block), 64 K registers, 2048 threads and 128 FP32 units; 50 MB of L2.
HOPPER_SXM = GpuSpec((9, 0), 132, 50 * MIB, 228 * KIB, 227 * KIB, 65536, 2048, 128)
# Blackwell B200 (compute capability 10.0, in HGX/DGX B200 and GB200): 148 SMs, each with 228 KB of shared
# memory (227 KB for one block), 64 K registers, 2048 threads and 128 FP32 units; 126 MB of L2 (two dies).
BLACKWELL_B200 = GpuSpec((10, 0), 148, 126 * MIB, 228 * KIB, 227 * KIB, 65536, 2048, 128)
# Blackwell Ultra B300 (compute capability 10.3): 160 SMs with B200's per-SM limits; L2 as B200's.
BLACKWELL_B300 = GpuSpec((10, 3), 160, 126 * MIB, 228 * KIB, 227 * KIB, 65536, 2048, 128)
# A100 SXM (compute capability 8.0): 108 SMs, each with 164 KB of shared memory (163 KB for one block), 64 K
# registers, 2048 threads and 64 FP32 units; 40 MB of L2.
AMPERE_A100 = GpuSpec((8, 0), 108, 40 * MIB, 164 * KIB, 163 * KIB, 65536, 2048, 64)


class Chip(NamedTuple):
    name: str  # as in --topology gpu:H200x8x4
    kinds: tuple[str, ...]  # substrings of jax's device_kind (lower case) naming this chip, most specific first
    bf16_flops: float  # dense, per second
    hbm_bytes: float  # capacity
    hbm_bandwidth: float  # bytes per second
    local_link: str  # the link within a slice or host, and one device's send bandwidth on it
    local_bandwidth: float
    remote_link: str  # the link between slices or hosts
    remote_bandwidth: float
    source: str
    gpu: GpuSpec | None = None  # a GPU's description for its compiler


CHIPS = (
    # TPU7x (Ironwood): per chip 2307 TFLOP/s bf16, 192 GiB at 7380 GB/s, 1200 GB/s bidirectional ICI over 6
    # ports (3D torus, as v5p), DCN 100 Gb/s. Each chip is two JAX devices (one per TensorCore, each with half of
    # the HBM), so a device gets half of every figure.
    Chip("tpu7x", ("tpu7x", "tpu v7"), 2307e12 / 2, 192 * 2**30 / 2, 7380 * GB / 2, "ici", 1200 * GB / 6 / 2, "dcn",
         100e9 / 8 / 2, "https://cloud.google.com/tpu/docs/tpu7x"),
    # v6e: 918 TFLOP/s, 32 GB at 1640 GB/s, 800 GB/s bidirectional ICI over 4 ports (2D torus), 4 x 200 Gb/s
    # NICs per host of 8 chips.
    Chip("v6e", ("tpu v6 lite", "tpu v6e"), 918e12, 32e9, 1640 * GB, "ici", 800 * GB / 4, "dcn", 4 * 200e9 / 8 / 8,
         "https://cloud.google.com/tpu/docs/v6e"),
    # v5e: 197 TFLOP/s, 16 GB at 819 GB/s, 400 GB/s bidirectional ICI over 4 ports, 2 x 100 Gb/s NICs per host
    # of 8 chips.
    Chip("v5e", ("tpu v5 lite", "tpu v5e"), 197e12, 16e9, 819 * GB, "ici", 400 * GB / 4, "dcn", 2 * 100e9 / 8 / 8,
         "https://cloud.google.com/tpu/docs/v5e"),
    # v5p (after v5e: "tpu v5" is also in v5e's kind): 459 TFLOP/s, 95 GiB at 2765 GB/s, 1200 GB/s
    # bidirectional ICI over 6 ports (3D torus), DCN 50 Gb/s per chip.
    Chip("v5p", ("tpu v5p", "tpu v5"), 459e12, 95 * 2**30, 2765 * GB, "ici", 1200 * GB / 6, "dcn", 50e9 / 8,
         "https://cloud.google.com/tpu/docs/v5p"),
    # H200 SXM: 989 TFLOP/s dense bf16 (1979 with sparsity), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s
    # bidirectional.
    Chip("H200", ("h200",), 989e12, 141e9, 4800 * GB, "nvlink", 900 * GB / 2, "network", 400e9 / 8,
         "https://www.nvidia.com/en-us/data-center/h200/", HOPPER_SXM),
    # H100 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional.
    Chip("H100", ("h100",), 989e12, 80e9, 3350 * GB, "nvlink", 900 * GB / 2, "network", 400e9 / 8,
         "https://www.nvidia.com/en-us/data-center/h100/", HOPPER_SXM),
    # GB200 (before B200, whose kind is in its name; NVL72: 72 GPUs in one NVLink domain, gpu:GB200x72xR): 2.5
    # PFLOP/s dense bf16 (180 for 72 GPUs), 186 GB HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s bidirectional, one
    # 400 Gb/s NIC per GPU.
    Chip("GB200", ("gb200",), 2500e12, 186e9, 8000 * GB, "nvlink", 1800 * GB / 2, "network", 400e9 / 8,
         "https://www.nvidia.com/en-us/data-center/gb200-nvl72/", BLACKWELL_B200),
    # B200 (HGX/DGX B200): 2.25 PFLOP/s dense bf16 (36 with sparsity for 8 GPUs), 180 GB HBM3e at 8 TB/s, NVLink 5
    # at 1.8 TB/s bidirectional, one 400 Gb/s ConnectX-7 NIC per GPU.
    Chip("B200", ("b200",), 2250e12, 180e9, 8000 * GB, "nvlink", 1800 * GB / 2, "network", 400e9 / 8,
         "https://www.nvidia.com/en-us/data-center/dgx-b200/", BLACKWELL_B200),
    # B300 (HGX B300, Blackwell Ultra): 2.25 PFLOP/s dense bf16, 288 GB HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s
    # bidirectional, one 800 Gb/s ConnectX-8 NIC per GPU.
    Chip("B300", ("b300",), 2250e12, 288e9, 8000 * GB, "nvlink", 1800 * GB / 2, "network", 800e9 / 8,
         "https://www.nvidia.com/en-us/data-center/hgx/", BLACKWELL_B300),
    # A100 SXM 80GB: 312 TFLOP/s dense bf16, 80 GB HBM2e at 2039 GB/s, NVLink 600 GB/s bidirectional; one
    # 200 Gb/s HDR NIC per GPU (DGX A100).
    Chip("A100", ("a100",), 312e12, 80e9, 2039 * GB, "nvlink", 600 * GB / 2, "network", 200e9 / 8,
         "https://www.nvidia.com/en-us/data-center/a100/", AMPERE_A100),
)


def chip_named(name: str) -> Chip | None:
    """The chip of --topology gpu:<name>x... (case-insensitive), or None."""
    return next((chip for chip in CHIPS if chip.name.lower() == name.lower()), None)


def chip_of_kind(device_kind: str) -> Chip | None:
    """The chip whose device kind this is (jax's `device.device_kind`), or None."""
    kind = device_kind.lower()
    return next((chip for chip in CHIPS if any(name in kind for name in chip.kinds)), None)
