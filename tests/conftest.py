"""Test-session setup: 8 virtual CPU devices for mesh tests (the Makefile sets the same), fp32 by default, and
one persistent XLA compilation cache for the session."""

import os

# before jax is imported; the collective timeout as the Makefile's (simulated devices share the cores)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_cpu_collective_call_terminate_timeout_seconds=600")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
# The tests' models are tiny: XLA:CPU's optimisation passes cost far more than they save (the suite takes about
# 40% longer with them). The commands the tests start choose for themselves (most set JAX_DISABLE_MOST_OPTIMIZATIONS).
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 in the environment runs the suite on the optimised path instead.
if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """Many tests compile the same tiny train step (each `train` or `make_step` call traces a new function, so
    jax.jit's in-memory cache never hits): XLA's persistent cache, shared by the xdist workers (the parent of
    a worker's base temp directory is the run's), compiles each program once per session. A size limit turns
    on its file lock, so two workers never read an entry half written."""
    root = tmp_path_factory.getbasetemp()
    directory = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "xla_cache"
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_compilation_cache_max_size", 2**32)
    # The commands the tests start share it too: left unset, their config.compilation_cache_dir is JAX's own
    # setting, this one (train/loop.py use_compilation_cache).
    os.environ.update(JAX_COMPILATION_CACHE_DIR=str(directory), JAX_COMPILATION_CACHE_MAX_SIZE=str(2**32))
    return directory
