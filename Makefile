# `make demo` and `make test` each set up .venv from nothing, then run.
#
# TORCH is the torch requirement installed before nbdist. The default, torch==2.13.0, is the CPU
# build on this project's CI machines. On your own machine install torch your own way first
# (CUDA, ROCm or CPU) and run `make test TORCH=`: nbdist's extras accept any torch >= 2.13.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nbdist-installed
comma := ,

.PHONY: demo notebooks test docs lint bench bench-scale gpu-wheels compat clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[torch,tf-cpu,test,browser$(if $(shell command -v mpicc),$(comma)mpi)]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/run_notebook.py notebooks/01_first_distributed_cell.ipynb build/01_first_distributed_cell.ipynb

# Re-execute the tutorials in place: their stored outputs are what nbval compares against.
notebooks: $(STAMP)
	$(PY) scripts/run_notebook.py --inplace notebooks/*.ipynb

test: $(STAMP)
	$(PY) -m ruff check nbdist tests scripts benchmarks
	$(PY) -m mypy
	$(PY) -m pytest

# The documentation site (mkdocs.yml, docs/) into build/docs/, any warning an error: the tutorials
# are rendered from their stored outputs (never executed), and a link to a missing page, anchor
# or repository file fails the build.
docs: $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	$(PY) -m mkdocs build --strict --site-dir build/docs

# Benchmarks: results under build/bench/ (see benchmarks/ and docs/performance.md).
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/log_cost.py
	$(PY) benchmarks/session_cell.py
	$(PY) benchmarks/curve_cost.py
	$(PY) benchmarks/launchers.py
	$(PY) benchmarks/profile_overhead.py
	$(PY) benchmarks/flight_recorder.py
	$(PY) benchmarks/course_server.py

# The kernel's side at 8..1024 ranks (simulated ranks, plus 2 real engines for the transport):
# build/bench/scale.{json,md}, about 2 minutes.
bench-scale: $(STAMP)
	$(PY) benchmarks/scale.py

# The wheels a bare, offline GPU machine needs beyond what it has (Python 3.12, CUDA torch, pytest,
# matplotlib, psutil, accelerate): into .whl/ (git-ignored) for scripts/device_check.sh; pinned to
# the versions in .venv when there is one.
gpu-wheels:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/gpu_wheels.py

# The torch integration tests against another torch, in .venv-compat/ (scripts/compat.py):
# make compat TORCH=torch==2.4.1 [PYTHON=python3.10] [PINS="ipython==8.12.0 ipykernel==6.20.0"].
# It downloads what it installs (PyPI's torch is a CUDA build, GBs), so it is not part of
# `make test`. The result goes to build/compat/.
compat:
	$(PYTHON) scripts/compat.py --torch "$(TORCH)" --python $(PYTHON) $(foreach p,$(PINS),--pin "$(p)")

lint: $(STAMP)
	$(PY) -m ruff check nbdist tests scripts benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .venv-compat build .pytest_cache .ruff_cache .mypy_cache
