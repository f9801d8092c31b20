#!/usr/bin/env bash
# Train on a Cloud TPU pod slice from this checkout: create (or queue) the slice, install on every worker, start
# the same command on every worker, stream worker 0's log, delete the slice on request.
#
#   launch/tpu_pod.sh [--dry-run] create  NAME --zone ZONE --type v5p-64 [--version V] [--spot] [--queued]
#   launch/tpu_pod.sh [--dry-run] install NAME --zone ZONE [--setup CMD]
#   launch/tpu_pod.sh [--dry-run] train   NAME --zone ZONE CONFIG WORKDIR [--config.key=value ...]
#   launch/tpu_pod.sh [--dry-run] delete  NAME --zone ZONE [--queued]
#   launch/tpu_pod.sh [--dry-run] run     NAME --zone ZONE --type v5p-64 [--version V] [--spot] [--queued]
#                                         [--delete] [--setup CMD] CONFIG WORKDIR [--config.key=value ...]
#
# `run` does create (unless the slice exists), install and train, and keeps going until the run finishes:
# when the trainer stops after its checkpoint (exit code 75: a preemption notice) or the slice is lost, it
# recreates the slice if needed, reinstalls and trains again, which resumes from the checkpoint. A storage
# outage (74) or a stop whose save outlasted its grace (76) trains again too, on every worker together, at most
# $DFLASH_JAX_RETRIES times (default 3) after a backoff (launch/retry.sh); the workers' own launcher reruns
# none (a worker rerunning alone would wait for the others). `--delete`
# deletes the slice at the end. --queued asks for the slice through a queued resource (it waits for capacity),
# --spot for spot capacity; every command takes --project P. `--setup CMD` runs a shell command on every worker
# after each install, e.g. mounting the shared storage that CONFIG's paths name (a recreated slice's workers
# start without their mounts, so it runs again there). `--dry-run` prints the commands instead of running them.
# The workdir, target and data must be buckets (gs://...) or mounts every worker sees.
set -euo pipefail

source "$(dirname "$0")/retry.sh"  # the trainer's exit codes (STOPPED, retryable) and the backoff
REMOTE_DIR=dflash_jax  # the checkout on each worker, under its home directory
LOG='$HOME/dflash_train.log' EXIT_FILE='$HOME/dflash_train.exit'  # on each worker; expanded there
usage() { sed -n '4,10p' "$0" | sed 's/^#  *//' >&2; exit 2; }

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
[ $# -ge 2 ] || usage
action=$1 name=$2
shift 2
zone="" type="" version="" project="" spot=() queued=0 delete_at_end=0 setup=""
while [ $# -gt 0 ]; do
  case $1 in
    --zone) zone=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --spot) spot=(--spot); shift ;;
    --queued) queued=1; shift ;;
    --delete) delete_at_end=1; shift ;;
    --setup) setup=$2; shift 2 ;;
    --*) echo "unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ -n "$zone" ] || { echo "--zone is required" >&2; usage; }
train_args=("$@")
# The TPU VM image for each generation (gcloud compute tpus versions list shows the others).
if [ -z "$version" ]; then
  case $type in
    v6e-*) version=v2-alpha-tpuv6e ;;
    v5p-*) version=v2-alpha-tpuv5 ;;
    v5litepod-*) version=v2-alpha-tpuv5-lite ;;
    *) version=tpu-ubuntu2204-base ;;
  esac
fi
where=(--zone="$zone")
[ -z "$project" ] || where+=(--project="$project")

quoted() {  # the words as a shell reads them back, single-quoted where needed
  local word words=()
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then words+=("$word"); else words+=("'${word//\'/\'\\\'\'}'"); fi
  done
  echo "${words[*]}"
}
run() {  # print, or run, one command
  if [ "$dry_run" = 1 ]; then quoted "$@"; else "$@"; fi
}
on_workers() {  # on_workers WORKERS COMMAND: a shell command on the slice's workers (all, or 0)
  run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker="$1" --command="$2"
}

create() {
  [ -n "$type" ] || { echo "--type is required (e.g. v5p-64)" >&2; usage; }
  if [ "$queued" = 1 ]; then  # waits in the queue until capacity is free, then stays until deleted
    run gcloud compute tpus queued-resources create "$name" --node-id="$name" "${where[@]}" \
      --accelerator-type="$type" --runtime-version="$version" ${spot[@]+"${spot[@]}"}
    if [ "$dry_run" = 1 ]; then echo "# wait until the queued resource is ACTIVE"; return; fi
    until [ "$(gcloud compute tpus queued-resources describe "$name" "${where[@]}" \
                 --format='value(state.state)')" = ACTIVE ]; do sleep 60; done
  else
    run gcloud compute tpus tpu-vm create "$name" "${where[@]}" --accelerator-type="$type" --version="$version" \
      ${spot[@]+"${spot[@]}"}
  fi
}

install() {  # this checkout (no .git, venvs, outputs, caches or the planners' local libtpu and CUDA plugin) to every
  # worker, its install, then --setup
  local archive=${TMPDIR:-/tmp}/dflash_jax-$name.tar.gz
  run tar -czf "$archive" -C "$(cd "$(dirname "$0")/.." && pwd)" --exclude=.git --exclude='.venv*' --exclude=out \
    --exclude=.libtpu --exclude=.cudaplan --exclude=__pycache__ --exclude=.pytest_cache --exclude='*.egg-info' .
  run gcloud compute tpus tpu-vm scp "$archive" "$name:dflash_jax.tar.gz" "${where[@]}" --worker=all
  run rm -f "$archive"
  on_workers all "mkdir -p $REMOTE_DIR && tar -xzf dflash_jax.tar.gz -C $REMOTE_DIR && $REMOTE_DIR/launch/install.sh tpu"
  [ -z "$setup" ] || on_workers all "$setup"
}

train() {  # start detached on every worker (an ssh that drops does not stop it); follow worker 0 to its exit
  [ ${#train_args[@]} -ge 2 ] || { echo "train needs CONFIG WORKDIR" >&2; usage; }
  local args
  args=$(printf ' %q' "${train_args[@]}")
  on_workers all "rm -f $EXIT_FILE; cd $REMOTE_DIR && DFLASH_JAX_RETRIES=0 setsid nohup bash -c 'launch/tpu_vm.sh \"\$@\" > $LOG 2>&1; echo \$? > $EXIT_FILE' _$args > /dev/null 2>&1 < /dev/null &"
  on_workers 0 "tail -n +1 -F $LOG & while [ ! -e $EXIT_FILE ]; do sleep 5; done; sleep 2; kill \$!; exit \$(cat $EXIT_FILE)"
}

delete() {
  if [ "$queued" = 1 ]; then
    run gcloud compute tpus queued-resources delete "$name" "${where[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$name" "${where[@]}" --quiet
  fi
}

slice_state() {
  gcloud compute tpus tpu-vm describe "$name" "${where[@]}" --format='value(state)' 2>/dev/null || echo MISSING
}

run_to_the_end() {
  if [ "$dry_run" = 1 ] || [ "$(slice_state)" = MISSING ]; then create; fi
  install
  local retry=0 seconds
  while true; do
    local status=0
    train || status=$?
    [ "$dry_run" = 0 ] || { echo "# on exit code $STOPPED or a lost slice: recreate it if lost, install, train again"
                            echo "# on exit code $STORAGE_OUTAGE or $STOP_GRACE_EXPIRED: train again, at most ${DFLASH_JAX_RETRIES:-3} times"
                            break; }
    [ "$status" != 0 ] || break
    local state
    state=$(slice_state)
    if [ "$state" != READY ]; then
      echo "slice $name is $state (exit code $status): recreating it to resume" >&2
      [ "$state" = MISSING ] || delete
      create
      install
    elif [ "$status" = "$STOPPED" ]; then
      echo "stopped after a checkpoint: training again to resume" >&2
    elif retryable "$status" && [ "$retry" -lt "${DFLASH_JAX_RETRIES:-3}" ]; then
      retry=$((retry + 1))
      seconds=$(retry_backoff "$retry")
      echo "exit code $status, which a rerun resumes from: training again ($retry of ${DFLASH_JAX_RETRIES:-3}) in $seconds s" >&2
      sleep "$seconds"
    else
      echo "training failed with exit code $status; the slice is kept (delete it with: $0 delete $name --zone $zone)" >&2
      exit "$status"
    fi
  done
  [ "$delete_at_end" = 0 ] || delete
}

case $action in
  create) create ;;
  install) install ;;
  train) train ;;
  delete) delete ;;
  run) run_to_the_end ;;
  *) usage ;;
esac
