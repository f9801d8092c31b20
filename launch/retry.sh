# Sourced by the launchers: the trainer's exit codes they act on (docs/failure_handling.md, "Exit codes") and
# the reruns of a failure that a rerun resumes from.
#
# 74: storage outage (the bucket did not answer within config.storage's deadline), 76: a stop whose checkpoint
# save outlasted config.stop_grace_seconds. Both leave the newest complete checkpoint in place, so the same
# command, run again, resumes from it: `run_with_retries` reruns it at most $DFLASH_JAX_RETRIES times (default
# 3), after $DFLASH_JAX_RETRY_BACKOFF seconds (default 60) doubling at each rerun, as a bucket takes minutes to
# come back. 75 (a stop that saved its checkpoint) is the scheduler's to act on: it asked for the stop.
STORAGE_OUTAGE=74 STOPPED=75 STOP_GRACE_EXPIRED=76

retryable() { [ "$1" = "$STORAGE_OUTAGE" ] || [ "$1" = "$STOP_GRACE_EXPIRED" ]; }

retry_backoff() {  # retry_backoff N: seconds before the Nth rerun (N = 1, 2, ...)
  echo $(( ${DFLASH_JAX_RETRY_BACKOFF:-60} << ($1 - 1) ))
}

# The command runs in the background with SIGTERM and SIGINT to this shell passed on to it as SIGTERM (the
# trainer's stop; a scheduler that signals only the launcher, such as Kubernetes signalling a container's first
# process, then still stops it cleanly). A shell waiting on a foreground command would run its trap only after
# the command ended. After such a signal nothing is rerun: the stop was asked for, and its exit code goes up.
_child="" _signalled=0 _interrupted=0
_pass_on() {
  _signalled=1 _interrupted=1
  [ -z "$_child" ] || kill -TERM "$_child" 2>/dev/null || true
}

run_passing_signals() {  # run_passing_signals COMMAND...: its exit code
  local status=0
  trap _pass_on TERM INT
  "$@" &
  _child=$!
  wait "$_child" || status=$?
  while [ "$_interrupted" = 1 ]; do  # `wait` returned for the trap: wait on (bash keeps the child's status)
    _interrupted=0 status=0
    wait "$_child" || status=$?
  done
  _child=""
  return "$status"
}

run_with_retries() {  # run_with_retries COMMAND...: COMMAND, rerun on a retryable exit code; the last exit code
  local retries=${DFLASH_JAX_RETRIES:-3} retry=0 status seconds
  while true; do
    status=0
    run_passing_signals "$@" || status=$?
    if [ "$status" = 0 ] || [ "$_signalled" = 1 ] || ! retryable "$status" || [ "$retry" -ge "$retries" ]; then
      return "$status"
    fi
    retry=$((retry + 1))
    seconds=$(retry_backoff "$retry")
    echo "exit code $status, which a rerun resumes from: rerun $retry of $retries in $seconds s" >&2
    sleep "$seconds" &  # in the background, so that a stop signal ends the wait at once
    _child=$!
    wait "$_child" || true
    _child=""
    [ "$_signalled" = 0 ] || return "$status"
  done
}
