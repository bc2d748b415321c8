# `make demo` and `make test` each set up .venv from nothing, then run.
#
# TORCH is the torch requirement installed before nbdist. The default, torch==2.13.0, is the CPU
# build on this project's CI machines. On your own machine install torch your own way first
# (CUDA, ROCm or CPU) and run `make test TORCH=`: nbdist's extras accept any torch >= 2.1.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nbdist-installed

.PHONY: demo notebooks test lint bench bench-scale gpu-wheels clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[torch,tf-cpu,test,browser]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/run_notebook.py notebooks/01_first_distributed_cell.ipynb build/01_first_distributed_cell.ipynb

# Re-execute the tutorials in place: their stored outputs are what nbval compares against.
notebooks: $(STAMP)
	$(PY) scripts/run_notebook.py --inplace notebooks/*.ipynb

test: $(STAMP)
	$(PY) -m ruff check nbdist tests scripts benchmarks
	$(PY) -m pytest

# Benchmarks: results under build/bench/ (see benchmarks/ and the README's Performance section).
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/log_cost.py
	$(PY) benchmarks/session_cell.py
	$(PY) benchmarks/curve_cost.py
	$(PY) benchmarks/launchers.py

# The kernel's side at 8..1024 ranks (simulated ranks, plus 2 real engines for the transport):
# build/bench/scale.{json,md}, about 2 minutes.
bench-scale: $(STAMP)
	$(PY) benchmarks/scale.py

# The wheels a bare, offline GPU machine needs beyond what it has (Python 3.12, CUDA torch, pytest,
# matplotlib, psutil, accelerate): into .whl/ (git-ignored) for scripts/device_check.sh; pinned to
# the versions in .venv when there is one.
gpu-wheels:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/gpu_wheels.py

lint: $(STAMP)
	$(PY) -m ruff check nbdist tests scripts benchmarks

clean:
	rm -rf $(VENV) build .pytest_cache
