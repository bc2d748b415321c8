"""Execute notebooks headless with nbclient and save the executed copies.

python scripts/run_notebook.py notebooks/01_first_distributed_cell.ipynb build/01.ipynb
python scripts/run_notebook.py --inplace notebooks/*.ipynb    # refresh nbval's references
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(src: Path, dst: Path, timeout: int) -> float:
    nb = nbformat.read(src, as_version=4)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    # The stored outputs are what nbval compares against, and the test suite runs its kernels
    # without the background start (tests/conftest.py): so do these, or a notebook whose first
    # nbdist line is %distrain connect or start -n N would store other notices than nbval sees.
    os.environ.setdefault("NBDIST_PRESTART", "0")
    start = time.perf_counter()
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(src.parent)}},
    ).execute()
    # Widget state holds random model ids; it would change the file on every run.
    nb.metadata.pop("widgets", None)
    dst.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dst)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--inplace", action="store_true", help="overwrite each notebook")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = p.parse_args(argv)
    if args.inplace:
        jobs = [(path, path) for path in args.paths]
    elif len(args.paths) == 2:
        jobs = [(args.paths[0], args.paths[1])]
    else:
        p.error("give SRC DST, or --inplace NOTEBOOK...")
    for src, dst in jobs:
        seconds = execute(src, dst, args.timeout)
        print(f"executed {src} -> {dst} in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
