"""Which attention backend runs, for the drafter's design §5 attention and the targets' full-sequence causal
attention: `attention_impl = auto | splash | xla`.

"auto" is splash on TPU (the block-sparse kernel skipping empty tiles) and the chunked XLA implementation
elsewhere. An explicit "splash" off TPU is honoured in the Pallas interpreter (correct but slow, with a logged
warning; see `ops/splash_attention.py`), which is how the tests compare the two backends on CPU.
"""

from __future__ import annotations

import jax

ATTENTION_CHOICES = ("auto", "splash", "xla")


def resolve_attention_impl(name: str, platform: str | None = None) -> str:
    """"auto" -> "splash" on TPU, else "xla"; "splash" and "xla" unchanged; anything else is a ValueError.
    platform: the devices the step is compiled for (default: JAX's default backend; the ahead-of-time plan
    compiles for a TPU topology from a CPU host)."""
    if name not in ATTENTION_CHOICES:
        raise ValueError(f"attention_impl must be one of {list(ATTENTION_CHOICES)}, got {name!r}")
    if name == "auto":
        return "splash" if (platform or jax.default_backend()) == "tpu" else "xla"
    return name
