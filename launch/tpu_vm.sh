#!/usr/bin/env bash
# Train a DFlash drafter on a Cloud TPU VM, one host (v5p-8, v6e-8) or a multi-host pod slice (v5p-64, ...):
# every chip of the slice is in the mesh; the drafter's attention runs as splash attention (attention_impl=auto
# picks it on TPU). On a pod, run the same command on every worker (--worker=all): JAX reads the slice's
# workers from the TPU metadata (--config.distributed=on). The repository must be at the same path on every
# worker, and the workdir on storage they all see (NFS, Filestore, a gcsfuse mount): each writes its shards
# of every checkpoint there.
#
#   gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --worker=all --command \
#     "cd dflash_jax && launch/tpu_vm.sh configs/qwen27b.py /mnt/shared/dflash-27b \
#        --config.target_dir=/mnt/shared/Qwen3.6-27B-orbax --config.data.train_files=/mnt/shared/data/train.jsonl"
#
# The target is best converted once with convert/hf_to_orbax.py so each chip restores only its shards.
# Rerun the same command to resume (SIGTERM from a preemption saves a checkpoint first). A storage outage
# (exit code 74) or a stop whose save outlasted its grace (76) is rerun here, a few times (launch/retry.sh).
set -euo pipefail
config=${1:?usage: launch/tpu_vm.sh CONFIG WORKDIR [--config.key=value ...]}
workdir=${2:?usage: launch/tpu_vm.sh CONFIG WORKDIR [--config.key=value ...]}
shift 2
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || launch/install.sh tpu
source launch/performance.sh  # libtpu's collective settings, overridable from the environment
tpu_performance_env
source launch/retry.sh
run_with_retries .venv/bin/python -m dflash_jax.train --config "$config" --workdir "$workdir" \
  --config.distributed=on "$@"
