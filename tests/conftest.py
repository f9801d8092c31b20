"""Test-session setup: 8 virtual CPU devices for mesh tests (the Makefile sets the same), fp32 by default."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax is imported

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
