#!/usr/bin/env bash
# Train a DFlash drafter on a single-host Cloud TPU VM (e.g. v5p-8, v6e-8): every local chip is in the mesh;
# the drafter's attention runs as splash attention (attention_impl=auto picks it on TPU).
#
#   gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --command \
#     "cd dflash_jax && launch/tpu_vm.sh configs/qwen27b.py /mnt/ckpt/dflash-27b \
#        --config.target_dir=/mnt/Qwen3.6-27B-orbax --config.train_files=/mnt/data/train.jsonl"
#
# The target is best converted once with convert/hf_to_orbax.py so each chip restores only its shards.
# Rerun the same command to resume (SIGTERM from a preemption saves a checkpoint first).
set -euo pipefail
config=${1:?usage: launch/tpu_vm.sh CONFIG WORKDIR [--config.key=value ...]}
workdir=${2:?usage: launch/tpu_vm.sh CONFIG WORKDIR [--config.key=value ...]}
shift 2
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q -e '.[tpu]'
fi
exec .venv/bin/python -m dflash_jax.train --config "$config" --workdir "$workdir" "$@"
