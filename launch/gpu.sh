#!/usr/bin/env bash
# Train a DFlash drafter on one GPU host (all its GPUs form the mesh: fsdp over every device by default).
#
#   launch/gpu.sh configs/qwen3_8b.py /ckpt/dflash-qwen3-8b \
#       --config.target_dir=/ckpt/Qwen3-8B --config.data.train_files=/data/train.jsonl
#
# Rerun the same command to resume; a storage outage (exit code 74) or a stop whose save outlasted its grace
# (76) is rerun here, a few times (launch/retry.sh). Installs the pinned package set on first use
# (launch/install.sh gpu).
# Several hosts: run it on each with JAX_COORDINATOR_ADDRESS=<host 0>:<port>, JAX_NUM_PROCESSES=<hosts> and
# JAX_PROCESS_ID=<0..hosts-1> set, and a workdir every host sees (see docs/training.md, "Multi-host pods").
set -euo pipefail
config=${1:?usage: launch/gpu.sh CONFIG WORKDIR [--config.key=value ...]}
workdir=${2:?usage: launch/gpu.sh CONFIG WORKDIR [--config.key=value ...]}
shift 2
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || launch/install.sh gpu
# Let XLA use most of each GPU's memory for the frozen target, the drafter and the step's temporaries.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
source launch/performance.sh  # XLA and NCCL settings, each overridable from the environment
gpu_performance_env
source launch/retry.sh
run_with_retries .venv/bin/python -m dflash_jax.train --config "$config" --workdir "$workdir" "$@"
