# One-command set-up: every target builds the virtual environment it needs.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
NPROC ?= 2
# pytest processes for `make test` (pytest-xdist): the suite's ranks wait on
# each other, torchrun and watchdog timeouts, so two keep two cores busy.
TEST_WORKERS ?= 2

.PHONY: venv train test bench test-system bench-gpu gpu-check clean

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
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

bench: venv
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_step.py

# On a machine whose python already has torch (e.g. a GPU box without network):
# no virtual environment, the source tree on PYTHONPATH.
# tests/gpu on the GPU; the rest is the CPU (gloo) suite, run with the GPU
# hidden (with one visible, PyTorch's fully_shard, the reference of many
# tests, builds its default mesh on CUDA).
test-system:
	PYTHONPATH=src $(PYTHON) -m pytest -q tests/gpu
	CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONPATH=src $(PYTHON) -m pytest -q --ignore=tests/gpu tests

bench-gpu:
	PYTHONPATH=src $(PYTHON) benchmarks/bench_gpu.py --json bench_gpu.json --trace gpu_trace

# Everything a lent GPU should run, in order: the CUDA tests, the GPU benchmark
# with its trace, the planner, then the CPU suite in parallel (GPU hidden).
gpu-check:
	PYTHON=$(PYTHON) SUITE_S=$${SUITE_S:-1200} bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
