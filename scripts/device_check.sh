#!/usr/bin/env bash
# The GPU check in one call, for a bare, offline machine with GPUs (Python 3.12, a CUDA build of
# torch, pytest, matplotlib, psutil, accelerate; nothing of the notebook stack):
#
#     make gpu-wheels                         # on a machine with the registry: fills .whl/
#     bash scripts/device_check.sh RESULTS    # on the GPU machine, from the repository root
#
# Installs .whl/ with pip install --no-index --no-deps --target (into a temporary folder), puts
# this working tree and that folder on PYTHONPATH (the engines inherit it), then runs
# `pytest -m gpu tests/gpu` and `benchmarks/launchers.py --tag gpu`. RESULTS gets:
#   env.txt       the machine: GPUs, driver, Python, torch, the installed packages
#   pytest.log    the test run, one line per test (-v) and a summary of every outcome (-rA)
#   pytest.xml    the same as JUnit XML
#   launchers-gpu.{md,json,png}, bench.log   the benchmark's table, records and output
#   summary.txt   each step's exit status and seconds
# Each step has a time limit and the whole script stays under DEVICE_CHECK_BUDGET_S (470 s by
# default), so two tries fit in 15 minutes of machine time. A step that fails or runs out of
# time does not stop the next one; the exit status is 0 only if every step passed.
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: bash scripts/device_check.sh RESULTS_DIR   (run from the repository root)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
REPO=$(pwd)
mkdir -p "$1"
RESULTS=$(cd "$1" && pwd)
PYTHON=${PYTHON:-python3}
BUDGET=${DEVICE_CHECK_BUDGET_S:-470}
SITE=$(mktemp -d "${TMPDIR:-/tmp}/nbdist-device-site.XXXXXX")
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
failed=0

# limit CAP RESERVE: CAP seconds, or what is left of the budget after RESERVE seconds are kept
# for the steps after this one (never under 10 s).
limit() {
  local cap=$1 reserve=$2
  local left=$((BUDGET - SECONDS - reserve))
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  if [ "$cap" -lt 10 ]; then cap=10; fi
  echo "$cap"
}

# step NAME SECONDS FUNCTION [ARGS]: run it under a time limit (SIGINT to all it started
# first, so pytest and the benchmark still report what they did; SIGKILL 15 s later), and
# record how it ended.
step() {
  local name=$1 seconds=$2 start=$SECONDS rc
  shift 2
  echo "=== $name (limit ${seconds} s)"
  timeout -s INT -k 15 "$seconds" bash -c '"$@"' "$name" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "$name: ran out of its ${seconds} s (exit $rc)" | tee -a "$SUMMARY"
  else
    echo "$name: exit $rc" >>"$SUMMARY"
  fi
  echo "$name: $((SECONDS - start)) s" >>"$SUMMARY"
  [ "$rc" -eq 0 ] || failed=1
  return "$rc"
}

install() {
  shopt -s nullglob
  local wheels=("$REPO"/.whl/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in .whl/: run 'make gpu-wheels' where the package registry is reachable," \
      "and carry .whl with the working tree" >&2
    return 1
  fi
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" \
      "${wheels[@]}"
  else
    # No pip: a wheel is a zip of what goes into site-packages (its .data/ holds only files
    # this check does not use: kernel specs, notebook extensions).
    echo "no pip for $PYTHON: unpacking the wheels instead"
    local w
    for w in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$w" "$SITE" || return 1; done
  fi
}

describe() {
  {
    date -u '+%Y-%m-%d %H:%M:%S UTC'
    uname -a
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1
    "$PYTHON" - <<'EOF'
import importlib
import importlib.metadata as md
import platform
import sys

print(f"Python {platform.python_version()} ({sys.executable})")
missing = []
for name in ("torch", "pytest", "matplotlib", "psutil", "accelerate", "ipyparallel", "ipython",
             "ipykernel", "jupyter_client", "pyzmq", "tornado", "traitlets", "ipywidgets"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: MISSING")
        missing.append(name)
# What the kernel and the engines import (nbdist from this working tree).
for module in ("torch", "IPython", "ipykernel", "ipyparallel", "zmq", "ipywidgets", "nbdist"):
    try:
        m = importlib.import_module(module)
    except Exception as e:
        print(f"import {module}: {type(e).__name__}: {e}")
        missing.append(module)
    else:
        print(f"import {module}: {m.__file__}")
if "torch" in sys.modules:
    import torch

    print(f"torch CUDA {torch.version.cuda}; is_available() {torch.cuda.is_available()}; "
          f"device_count() {torch.cuda.device_count()}")
sys.exit(1 if missing else 0)
EOF
  } 2>&1 | tee -i "$RESULTS/env.txt"
  return "${PIPESTATUS[0]}"
}

gpu_tests() {
  "$PYTHON" -m pytest tests/gpu -m gpu -v -rA -p no:cacheprovider -o addopts="" \
    --junitxml="$RESULTS/pytest.xml" 2>&1 | tee -i "$RESULTS/pytest.log"
  return "${PIPESTATUS[0]}"
}

gpu_bench() {
  local seconds=$1
  # No repetition starts in the last ~70 s: one (torchrun, then a cold, warm and nolive
  # %%distrain) takes well under that on one GPU, and the results are written after each.
  "$PYTHON" benchmarks/launchers.py --tag gpu --reps 3 --budget-s $((seconds - 70)) \
    --out-dir "$RESULTS" 2>&1 | tee -i "$RESULTS/bench.log"
  return "${PIPESTATUS[0]}"
}

# Cluster processes a killed run left behind (found through nbdist's run records, by PID and
# start time): stopped, so they do not hold the GPU for the next step.
leftovers() {
  "$PYTHON" -c "from nbdist.kernel.runfiles import clean_stale; n = clean_stale(); \
print(f'leftover cluster processes stopped: {n}')"
}

# The steps run in a child bash under `timeout`: it needs the functions and settings.
export -f install describe gpu_tests gpu_bench leftovers
export REPO RESULTS PYTHON SITE
step install "$(limit 60 400)" install
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg IPP_NONINTERACTIVE=1
step describe "$(limit 45 360)" describe
step gpu-tests "$(limit 180 170)" gpu_tests
step leftovers 20 leftovers
bench_s=$(limit 150 10)
step gpu-benchmark "$bench_s" gpu_bench "$bench_s"
step leftovers 20 leftovers
rm -rf "$SITE"
echo "=== summary (total $SECONDS s)"
echo "total: $SECONDS s" >>"$SUMMARY"
cat "$SUMMARY"
exit "$failed"
