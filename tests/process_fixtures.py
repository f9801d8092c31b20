"""Commands run as processes: two processes of one `jax.distributed` run on CPU devices, and their outputs; a
command on a disk that is full."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]


DEVICES_PER_PROCESS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def cpu_env(devices: int) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                JAX_DISABLE_MOST_OPTIMIZATIONS="1", PYTHONPATH=str(REPO))


def start_two_processes(command: list[str]) -> list[subprocess.Popen]:
    """`command` as processes 0 and 1 of one run, four CPU devices each."""
    env = dict(cpu_env(DEVICES_PER_PROCESS), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",  # across processes
               JAX_COORDINATOR_ADDRESS=f"localhost:{free_port()}", JAX_NUM_PROCESSES="2")
    return [subprocess.Popen(command, cwd=REPO, env=dict(env, JAX_PROCESS_ID=str(index)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for index in (0, 1)]


def outputs_of(processes: list[subprocess.Popen], returncode: int = 0) -> list[str]:
    try:
        outputs = [process.communicate(timeout=300)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()  # no-op once exited; a hung peer must not outlive the test
    for index, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == returncode, f"process {index}:\n{output[-3000:]}"
    return outputs


def on_a_full_disk(command: list[str], directory: Path, free: int, size: int = 2**20) -> list[str]:
    """`command`, run with a tmpfs of `size` bytes over `directory` holding a file that leaves `free` bytes, in a
    mount namespace of its own (`unshare --user --map-root-user --mount`: no privilege needed where user
    namespaces are enabled)."""
    script = 'mount -t tmpfs -o size="$2" tmpfs "$1" && head -c "$3" /dev/zero > "$1/filler" && shift 3 && exec "$@"'
    directory.mkdir(parents=True, exist_ok=True)
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", str(directory), str(size),
            str(size - free), *command]
