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


def compile_platform() -> str:
    """The platform of the computation being traced: the mesh's in the trace context (the ahead-of-time plan
    compiles for TPUs from a CPU host), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return jax.default_backend() if device is None else device.platform
