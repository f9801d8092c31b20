"""Which attention backend runs, for the drafter's design §5 attention and the targets' full-sequence causal
attention: `attention_impl = auto | cudnn | splash | xla`.

"auto" is splash on TPU (the block-sparse kernel skipping empty tiles), cuDNN's flash attention on GPU for the
targets (`ops/attention.py` `causal_attention_fused`; it falls back to the XLA query chunks where cuDNN cannot
take the shapes or dtype) and the chunked XLA implementation elsewhere. The drafter's design §5 mask is not
causal, so under "cudnn" the drafter runs its chunked XLA attention. An explicit "splash" off TPU is honoured
in the Pallas interpreter (correct but slow, with a logged warning; see `ops/splash_attention.py`), which is how
the tests compare the two backends on CPU.
"""

from __future__ import annotations

import jax

ATTENTION_CHOICES = ("auto", "cudnn", "splash", "xla")


def resolve_attention_impl(name: str, platform: str | None = None) -> str:
    """"auto" -> "splash" on TPU, "cudnn" on GPU, else "xla"; the others unchanged; anything else is a ValueError.
    platform: the devices the step is compiled for (default: JAX's default backend; the ahead-of-time plan
    compiles for a TPU topology from a CPU host)."""
    if name not in ATTENTION_CHOICES:
        raise ValueError(f"attention_impl must be one of {list(ATTENTION_CHOICES)}, got {name!r}")
    if name == "auto":
        return {"tpu": "splash", "gpu": "cudnn"}.get(platform or jax.default_backend(), "xla")
    return name


def compile_device():
    """The device the computation being traced is compiled for: one of this process's devices, unless the mesh
    in the trace context is another platform's (the ahead-of-time plan compiles for TPUs or GPUs from a CPU
    host), whose abstract device (platform, device_kind) then stands for it."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return jax.devices()[0] if device is None or device.platform == jax.default_backend() else device


def compile_platform() -> str:
    """The platform of the computation being traced (`compile_device`): "cpu", "gpu" or "tpu"."""
    return compile_device().platform
