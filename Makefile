# One-command set-up: every target builds the virtual environment it needs.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: venv train test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so the package's own torch requirement installs nothing more
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

train: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/shardwise train --nproc $(NPROC)

test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

bench: venv
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_step.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
