#!/usr/bin/env bash
# Install this checkout with the tested, pinned package set (launch/constraints.txt) for one platform:
#
#   launch/install.sh tpu   # Cloud TPU VM: jax[tpu] (JAX 0.10.2, libtpu 0.0.42.1) and gcsfs for gs:// workdirs
#   launch/install.sh gpu   # NVIDIA GPU host: jax[cuda12] (CUDA 12.9 wheels) and gcsfs
#   launch/install.sh cpu   # CPU only (development)
#
# into .venv (or $VENV), then checks the set with `pip check` and lists the devices JAX sees. It needs Python
# 3.11 or newer; where the system has none (the Ubuntu 22.04 TPU VM images have 3.10), it installs `uv` for
# the user and lets uv provide Python 3.11.
set -euo pipefail
case ${1:-} in
  tpu) extras="[tpu,gcs]" ;;
  gpu) extras="[gpu,gcs]" ;;
  cpu) extras="" ;;
  *) echo "usage: launch/install.sh tpu|gpu|cpu" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}

python_at_least_3_11() {
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}
if [ ! -x "$venv/bin/python" ]; then
  python=""
  for candidate in python3 python3.13 python3.12 python3.11; do
    if command -v "$candidate" >/dev/null && python_at_least_3_11 "$candidate"; then python=$candidate; break; fi
  done
  if [ -n "$python" ]; then
    "$python" -m venv "$venv"
  else
    python3 -m pip install -q --user uv
    python3 -m uv venv --seed --python 3.11 "$venv"
  fi
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c launch/constraints.txt -e ".$extras"
"$venv/bin/python" -m pip check
"$venv/bin/python" -c 'import jax; print(f"jax {jax.__version__}, {jax.device_count()} devices: {jax.devices()}")'
