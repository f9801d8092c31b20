# dflash_jax: `make test` (fast suite), `make test-slow` (longer checks), `make demo` (toy end-to-end job).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: venv test test-slow demo clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m "not slow" tests

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow tests

clean:
	rm -rf $(VENV) out
