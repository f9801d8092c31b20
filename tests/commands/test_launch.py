"""The launchers: their --dry-run prints the exact commands (no gcloud, srun or network needed), and their
requeue logic runs against stand-ins for gcloud/srun/scontrol that record each call and answer as the cloud
or the scheduler would (a stop with exit code 75, a preempted slice)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["configs/qwen27b.py", "gs://bucket/run1", "--config.total_steps=10", "--config.data.train_files=gs://b/d it's"]


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / script), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": os.environ["HOME"], "TMPDIR": "/tmp",
                                            **(env or {})})


def test_tpu_pod_dry_run_prints_every_command_of_a_run():
    result = run("tpu_pod.sh", "--dry-run", "run", "pod1", "--zone", "us-east5-a", "--type", "v5p-64", "--queued",
                 "--spot", "--delete", *TRAIN)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    where = "--zone=us-east5-a"
    assert lines[0] == ("gcloud compute tpus queued-resources create pod1 --node-id=pod1 --zone=us-east5-a "
                        "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5 --spot")
    assert lines[1] == "# wait until the queued resource is ACTIVE"
    assert lines[2].startswith("tar -czf /tmp/dflash_jax-pod1.tar.gz -C ")
    assert lines[3] == f"gcloud compute tpus tpu-vm scp /tmp/dflash_jax-pod1.tar.gz pod1:dflash_jax.tar.gz {where} --worker=all"
    assert lines[4] == "rm -f /tmp/dflash_jax-pod1.tar.gz"
    assert lines[5] == (f"gcloud compute tpus tpu-vm ssh pod1 {where} --worker=all '--command=mkdir -p dflash_jax && "
                        "tar -xzf dflash_jax.tar.gz -C dflash_jax && dflash_jax/launch/install.sh tpu'")
    # The same training command starts, detached, on every worker; worker 0's log is followed to its exit code.
    assert lines[6].startswith(f"gcloud compute tpus tpu-vm ssh pod1 {where} --worker=all '--command=rm -f ")
    assert ("launch/tpu_vm.sh \"$@\" > $HOME/dflash_train.log 2>&1; echo $? > $HOME/dflash_train.exit'\\'' _ "
            "configs/qwen27b.py gs://bucket/run1 --config.total_steps=10 "
            "--config.data.train_files=gs://b/d\\ it\\'\\''s > /dev/null") in lines[6]
    assert lines[7].startswith(f"gcloud compute tpus tpu-vm ssh pod1 {where} --worker=0 '--command=tail -n +1 -F ")
    assert lines[8] == "# on exit code 75 or a lost slice: recreate it if lost, install, train again"
    assert lines[9] == "# on exit code 74 or 76: train again, at most 3 times"
    assert lines[10] == f"gcloud compute tpus queued-resources delete pod1 {where} --force --quiet"
    assert len(lines) == 11


def test_tpu_pod_dry_run_of_single_steps():
    create = run("tpu_pod.sh", "--dry-run", "create", "v6", "--zone", "europe-west4-a", "--type", "v6e-64",
                 "--project", "p1")
    assert create.stdout == ("gcloud compute tpus tpu-vm create v6 --zone=europe-west4-a --project=p1 "
                             "--accelerator-type=v6e-64 --version=v2-alpha-tpuv6e\n")
    delete = run("tpu_pod.sh", "--dry-run", "delete", "v6", "--zone", "europe-west4-a")
    assert delete.stdout == "gcloud compute tpus tpu-vm delete v6 --zone=europe-west4-a --quiet\n"
    missing = run("tpu_pod.sh", "--dry-run", "train", "v6", "--zone", "europe-west4-a")
    assert missing.returncode == 2 and "train needs CONFIG WORKDIR" in missing.stderr


def fake_commands(directory: Path, scripts: dict[str, str]) -> dict[str, str]:
    """Executables standing in for the cloud/scheduler CLIs: each logs its arguments, then runs its script."""
    directory.mkdir()
    for name, body in scripts.items():
        path = directory / name
        path.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "$CALLS"\n{body}\n')
        path.chmod(0o755)
    return {"PATH": f"{directory}:/usr/bin:/bin", "CALLS": str(directory / "calls.log")}


# gcloud as a slice that exists: worker 0's training exits with the codes listed in $EXITS one per run; the
# slice is READY unless $PREEMPTED_AFTER runs have happened.
GCLOUD = """
case "$*" in
  *"tpu-vm describe"*)
    runs=$(grep -c -- "--worker=0" "$CALLS" || true)
    if [ -n "${PREEMPTED_AFTER:-}" ] && [ "$runs" = "$PREEMPTED_AFTER" ] && ! grep -q "tpu-vm delete" "$CALLS"; then
      echo PREEMPTED
    else
      echo READY
    fi ;;
  *"--worker=0"*)
    runs=$(grep -c -- "--worker=0" "$CALLS")
    exit $(echo $EXITS | cut -d' ' -f"$runs") ;;
esac
"""


def calls(env: dict[str, str]) -> list[str]:
    """The recorded calls, each shortened to its command and first distinguishing words."""
    return [" ".join(line.split()[:5]) for line in Path(env["CALLS"]).read_text().splitlines()]


def test_tpu_pod_run_trains_again_after_a_stop_with_exit_code_75(tmp_path):
    env = {**fake_commands(tmp_path / "bin", {"gcloud": GCLOUD}), "EXITS": "75 0"}
    result = run("tpu_pod.sh", "run", "pod2", "--zone", "z", "--type", "v5p-8", *TRAIN, env=env)
    assert result.returncode == 0, result.stderr
    assert "stopped after a checkpoint: training again to resume" in result.stderr
    assert calls(env) == [
        "gcloud compute tpus tpu-vm describe",  # exists: not created again
        "gcloud compute tpus tpu-vm scp", "gcloud compute tpus tpu-vm ssh",  # install
        "gcloud compute tpus tpu-vm ssh", "gcloud compute tpus tpu-vm ssh",  # start, follow: 75
        "gcloud compute tpus tpu-vm describe",
        "gcloud compute tpus tpu-vm ssh", "gcloud compute tpus tpu-vm ssh",  # start, follow: 0
    ]


def test_tpu_pod_run_recreates_a_preempted_slice_mounts_its_storage_again_and_resumes(tmp_path):
    env = {**fake_commands(tmp_path / "bin", {"gcloud": GCLOUD}), "EXITS": "255 0", "PREEMPTED_AFTER": "1"}
    mount = "mkdir -p /mnt/shared && gcsfuse my-bucket /mnt/shared"
    result = run("tpu_pod.sh", "run", "pod3", "--zone", "z", "--type", "v5p-8", "--delete", "--setup", mount, *TRAIN,
                 env=env)
    assert result.returncode == 0, result.stderr
    assert "slice pod3 is PREEMPTED (exit code 255): recreating it to resume" in result.stderr
    assert calls(env)[6:] == [
        "gcloud compute tpus tpu-vm describe", "gcloud compute tpus tpu-vm delete", "gcloud compute tpus tpu-vm create",
        "gcloud compute tpus tpu-vm scp", "gcloud compute tpus tpu-vm ssh",  # install again
        "gcloud compute tpus tpu-vm ssh",  # --setup again: the new workers' mounts
        "gcloud compute tpus tpu-vm ssh", "gcloud compute tpus tpu-vm ssh",  # train: resumes
        "gcloud compute tpus tpu-vm delete",  # --delete at the end
    ]
    setups = [line for line in Path(env["CALLS"]).read_text().splitlines() if line.endswith(f"--command={mount}")]
    assert len(setups) == 2 and all("--worker=all" in line for line in setups)  # after each install


def test_tpu_pod_run_stops_on_a_training_failure(tmp_path):
    env = {**fake_commands(tmp_path / "bin", {"gcloud": GCLOUD}), "EXITS": "2"}
    result = run("tpu_pod.sh", "run", "pod4", "--zone", "z", "--type", "v5p-8", "--delete", *TRAIN, env=env)
    assert result.returncode == 2
    assert "training failed with exit code 2; the slice is kept" in result.stderr
    assert "tpu-vm delete" not in Path(env["CALLS"]).read_text()


@pytest.mark.parametrize("exits, retries, code, runs", [("74 76 0", None, 0, 3), ("74 74 74", "2", 74, 3)])
def test_tpu_pod_run_trains_again_after_a_storage_outage_or_an_expired_grace_a_bounded_number_of_times(
        tmp_path, exits, retries, code, runs):
    env = {**fake_commands(tmp_path / "bin", {"gcloud": GCLOUD}), "EXITS": exits, "DFLASH_JAX_RETRY_BACKOFF": "0",
           **({"DFLASH_JAX_RETRIES": retries} if retries else {})}
    result = run("tpu_pod.sh", "run", "pod5", "--zone", "z", "--type", "v5p-8", *TRAIN, env=env)
    assert result.returncode == code, result.stderr
    log = Path(env["CALLS"]).read_text().splitlines()
    starts = [line for line in log if "--worker=all" in line and "tpu_vm.sh" in line]
    assert len(starts) == runs and len(set(starts)) == 1  # the same command on every worker each time
    assert all("DFLASH_JAX_RETRIES=0 " in line for line in starts)  # the pod reruns, not each worker alone
    assert "training again (1 of " in result.stderr
    if code:
        assert "training failed with exit code 74" in result.stderr


def local_launcher(tmp_path: Path, script: str, python: str) -> tuple[Path, dict[str, str]]:
    """A copy of `script` with the launch/ files it sources, in a checkout whose .venv/bin/python is a stand-in
    that logs its arguments and runs `python` (a shell script)."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    for name in (script, "retry.sh", "performance.sh"):
        (repo / "launch" / name).write_text((REPO / "launch" / name).read_text())
    (repo / ".venv").mkdir()
    env = fake_commands(repo / ".venv" / "bin", {"python": python})
    return repo / "launch" / script, {**env, "PATH": "/usr/bin:/bin", "DFLASH_JAX_RETRY_BACKOFF": "0"}


# The trainer's stand-in: the exit codes listed in $EXITS, one per run.
EXITING = 'exit $(echo $EXITS | cut -d" " -f"$(grep -c "^python" "$CALLS")")'


@pytest.mark.parametrize("script", ["gpu.sh", "tpu_vm.sh"])
@pytest.mark.parametrize("exits, retries, code, runs", [
    ("74 74 0", None, 0, 3),  # a storage outage twice, then the run ends
    ("76 0", None, 0, 2),  # a stop whose save outlasted its grace (the signal was not the launcher's)
    ("2", None, 2, 1),  # a user error: never rerun
    ("75", None, 75, 1),  # a stop that saved its checkpoint: the scheduler's to requeue
    ("74 74 74 74", "2", 74, 3),  # at most DFLASH_JAX_RETRIES reruns
])
def test_local_launchers_rerun_the_same_command_on_74_and_76_a_bounded_number_of_times(
        tmp_path, script, exits, retries, code, runs):
    launcher, env = local_launcher(tmp_path, script, EXITING)
    env = {**env, "EXITS": exits, **({"DFLASH_JAX_RETRIES": retries} if retries else {})}
    result = subprocess.run(["bash", str(launcher), *TRAIN], capture_output=True, text=True, timeout=60,
                            env={"HOME": os.environ["HOME"], **env})
    assert result.returncode == code, result.stderr
    commands = Path(env["CALLS"]).read_text().splitlines()
    assert len(commands) == runs and len(set(commands)) == 1, commands
    assert commands[0].startswith("python -m dflash_jax.train --config configs/qwen27b.py --workdir gs://bucket/run1 ")
    assert result.stderr.count("which a rerun resumes from: rerun") == runs - 1


def test_a_local_launcher_passes_a_stop_signal_on_and_reruns_nothing_after_it(tmp_path):
    """SIGTERM to the launcher alone (a container's first process) reaches the trainer as SIGTERM; its exit code
    76 then goes up unchanged: the stop was asked for."""
    import signal
    import time

    trainer = 'trap \'echo "python got TERM" >> "$CALLS"; kill $!; exit 76\' TERM\nsleep 60 &\nwait'
    launcher, env = local_launcher(tmp_path, "gpu.sh", trainer)
    process = subprocess.Popen(["bash", str(launcher), *TRAIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={"HOME": os.environ["HOME"], **env})
    calls = Path(env["CALLS"])
    deadline = time.monotonic() + 60
    while not (calls.exists() and "python " in calls.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the trainer's trap is set once it runs its `sleep`
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 76, err
    assert calls.read_text().splitlines()[1:] == ["python got TERM"]  # one run, stopped by the passed-on signal


def test_the_retry_backoff_doubles_from_its_base():
    script = "source launch/retry.sh; for n in 1 2 3; do retry_backoff $n; done"
    backoffs = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                              env={"PATH": "/usr/bin:/bin", "DFLASH_JAX_RETRY_BACKOFF": "5"}).stdout.split()
    assert backoffs == ["5", "10", "20"]
    default = subprocess.run(["bash", "-c", "source launch/retry.sh; retry_backoff 1"], cwd=REPO, check=True,
                             capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert default == ["60"]


SLURM = {"SLURM_JOB_NODELIST": "gpu-[003-006,9]", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "1234",
         "SLURM_SUBMIT_DIR": "/shared/dflash_jax"}


def test_slurm_dry_run_prints_the_srun_command_with_the_coordinator_from_slurm():
    result = run("slurm.sbatch", "--dry-run", *TRAIN, env=SLURM)
    assert result.returncode == 0, result.stderr
    command, retry, requeue = result.stdout.splitlines()
    assert command.startswith("srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 env "
                              "JAX_COORDINATOR_ADDRESS=gpu-003:29500 JAX_NUM_PROCESSES=4 ")
    assert "JAX_PROCESS_ID=\\$SLURM_PROCID" in command
    assert command.endswith("/shared/dflash_jax/.venv/bin/python --config configs/qwen27b.py --workdir "
                            "gs://bucket/run1 --config.total_steps=10 --config.data.train_files=gs://b/d\\ it\\'s ")
    assert retry == "# on exit code 74, or 76 without a stop signal: srun again, at most ${DFLASH_JAX_RETRIES:-3} times"
    assert requeue == "# on exit code 75 or 76: scontrol requeue $SLURM_JOB_ID"


@pytest.mark.parametrize("exit_code, requeued", [(75, True), (76, True), (0, False), (1, False)])
def test_slurm_requeues_the_job_exactly_when_the_run_stopped_with_75_or_76(tmp_path, exit_code, requeued):
    env = {**SLURM, "SLURM_SUBMIT_DIR": str(REPO), "DFLASH_JAX_RETRY_BACKOFF": "0",
           **fake_commands(tmp_path / "bin", {"srun": f"exit {exit_code}", "scontrol": "true"})}
    result = run("slurm.sbatch", *TRAIN, env=env)
    assert result.returncode == exit_code
    assert ("scontrol requeue 1234" in Path(env["CALLS"]).read_text()) == requeued


@pytest.mark.parametrize("exits, code, runs, requeued", [
    ("74 74 0", 0, 3, False),  # storage outages: srun again in the allocation
    ("76 0", 0, 2, False),  # an expired grace without a signal to the batch shell: srun again
    ("2", 2, 1, False),
    ("74 74 74 74", 74, 4, False),  # three reruns at most
])
def test_slurm_runs_srun_again_on_a_storage_outage_a_bounded_number_of_times(tmp_path, exits, code, runs, requeued):
    env = {**SLURM, "SLURM_SUBMIT_DIR": str(REPO), "EXITS": exits, "DFLASH_JAX_RETRY_BACKOFF": "0",
           **fake_commands(tmp_path / "bin", {"srun": EXITING.replace("^python", "^srun"), "scontrol": "true"})}
    result = run("slurm.sbatch", *TRAIN, env=env)
    assert result.returncode == code, result.stderr
    log = Path(env["CALLS"]).read_text().splitlines()
    assert len([line for line in log if line.startswith("srun ")]) == runs
    assert ("scontrol requeue 1234" in log) == requeued


def test_slurm_requeues_when_the_batch_shell_itself_gets_the_stop_signal(tmp_path):
    """--signal=B:TERM@300 (and a preemption) signal the batch shell: it passes SIGTERM on to srun, waits for
    the trainers' exit code 75 and requeues, instead of dying before its requeue line."""
    import signal
    import time

    assert "#SBATCH --signal=B:TERM@300" in (REPO / "launch" / "slurm.sbatch").read_text()
    srun = 'trap \'echo "srun got TERM" >> "$CALLS"; kill $!; exit 75\' TERM\nsleep 60 &\nwait'  # $!: the sleep
    env = {**SLURM, "SLURM_SUBMIT_DIR": str(REPO), **fake_commands(tmp_path / "bin", {"srun": srun, "scontrol": "true"})}
    batch = subprocess.Popen(["bash", str(REPO / "launch" / "slurm.sbatch"), *TRAIN], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={"PATH": "/usr/bin:/bin", "HOME": os.environ["HOME"], "TMPDIR": "/tmp", **env})
    calls = Path(env["CALLS"])
    deadline = time.monotonic() + 60
    while not (calls.exists() and "srun " in calls.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # srun's trap is set once it runs its `sleep`
    batch.send_signal(signal.SIGTERM)
    out, err = batch.communicate(timeout=60)
    assert batch.returncode == 75, err
    log = calls.read_text()
    assert "srun got TERM" in log and "scontrol requeue 1234" in log, log


def test_performance_settings_are_defaults_the_environment_overrides_and_xla_knows_them():
    def settings(function: str, **env: str) -> list[str]:
        script = f"source launch/performance.sh; {function}; printf '%s\\n' \"$XLA_FLAGS\" \"$NCCL_DEBUG\" \"$LIBTPU_INIT_ARGS\""
        return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                              env={"PATH": "/usr/bin:/bin", **env}).stdout.split("\n")[:3]

    xla_flags, nccl_debug, libtpu = settings("gpu_performance_env")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in xla_flags and nccl_debug == "WARN" and not libtpu
    assert settings("gpu_performance_env", XLA_FLAGS="--mine", NCCL_DEBUG="INFO")[:2] == ["--mine", "INFO"]
    assert settings("gpu_performance_env", XLA_FLAGS="")[0] == ""  # set empty: no defaults
    libtpu = settings("tpu_performance_env")[2]
    assert "--xla_tpu_enable_async_collective_fusion=true" in libtpu
    assert settings("tpu_performance_env", LIBTPU_INIT_ARGS="--mine")[2] == "--mine"
    for name in ("launch/gpu.sh", "launch/tpu_vm.sh", "launch/slurm.sbatch"):
        assert "source launch/performance.sh" in (REPO / name).read_text(), name
    # XLA aborts on a flag it does not know; the pinned jaxlib parses the GPU flags on any backend.
    check = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"})
    assert check.returncode == 0, check.stderr[-2000:]


@pytest.mark.slow
def test_install_script_installs_the_pinned_set_in_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    result = subprocess.run(["bash", str(REPO / "launch" / "install.sh"), "cpu"], cwd=REPO, capture_output=True,
                            text=True, timeout=1800,  # no byte-compiling of what this venv never imports
                            env={**os.environ, "VENV": str(venv), "PIP_NO_COMPILE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "jax 0.10.2, 1 devices" in result.stdout or "jax 0.10.2, 8 devices" in result.stdout
    pins = dict(line.split("==") for line in (REPO / "launch" / "constraints.txt").read_text().splitlines()
                if "==" in line)
    frozen = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
                            capture_output=True, text=True, check=True).stdout
    installed = {name.lower().replace("_", "-"): version
                 for name, version in (line.split("==") for line in frozen.splitlines() if "==" in line)}
    assert installed and all(pins[name] == version for name, version in installed.items() if name in pins)
    assert installed["jax"] == "0.10.2" and installed["flax"] == pins["flax"]
