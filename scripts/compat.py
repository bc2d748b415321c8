"""Run nbdist's torch tests against other versions: another torch, ipyparallel, IPython,
ipykernel or Python, in a virtual environment of their own.

    python scripts/compat.py --torch torch==2.4.1 [--python python3.10] [--pin ipython==8.12 ...]

(``make compat TORCH=torch==2.4.1`` calls it.) It makes ``.venv-compat/<name>`` (``--keep``:
reuses it), installs the versions asked for, nbdist as the checkout is now, and its test tools
(TensorFlow and the libraries tests left out: the torch tests are what a torch floor needs),
then runs the integration tests marked ``torch`` (not ``tf``, ``gpu``, ``browser``). A torch
release from PyPI is a CUDA build with its nvidia-* packages: gigabytes to download, which is
why this is not part of ``make test``. The result, with every version installed, goes to
``build/compat/<name>.md`` (pytest's whole output beside it, ``<name>.log``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ["pytest>=8", "nbval>=0.11", "nbclient>=0.10", "nbformat>=5.9"]
SHOWN = ("torch", "ipyparallel", "ipython", "ipykernel", "jupyter_client", "pyzmq", "numpy")
MARKERS = "torch and not tf and not gpu and not browser"


def _name(python: str, pins: list[str]) -> str:
    parts = [Path(python).name] + [re.sub(r"[^\w.]+", "", p) for p in pins]
    return "-".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--torch", required=True, help="the torch requirement, e.g. torch==2.4.1")
    p.add_argument("--python", default=sys.executable, help="the Python to make the venv with")
    p.add_argument("--pin", action="append", default=[], help="another requirement to install")
    p.add_argument("--keep", action="store_true", help="reuse the venv if it exists")
    args = p.parse_args(argv)
    pins = [args.torch, *args.pin]
    name = _name(args.python, pins)
    venv = ROOT / ".venv-compat" / name
    report = ROOT / "build" / "compat" / f"{name}.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    py = venv / "bin" / "python"
    if venv.exists() and not args.keep:
        shutil.rmtree(venv)
    start = time.monotonic()
    if not py.exists():
        subprocess.run([args.python, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        # First what is asked for, then nbdist's requirements and the test tools.
        subprocess.run([*pip, *pins], check=True)
        subprocess.run([*pip, str(ROOT), *TOOLS, *pins], check=True)
    # nbdist itself as it is now, copied into the venv (not editable: a run takes minutes, and
    # the checkout may change meanwhile).
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)],
        check=True,
    )
    installed = subprocess.run(
        [str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    ).stdout
    versions = [
        line
        for line in installed.splitlines()
        if line.split("==")[0].lower().replace("-", "_") in SHOWN
    ]
    pyver = subprocess.run([str(py), "--version"], capture_output=True, text=True).stdout.strip()
    setup_s = time.monotonic() - start
    test = subprocess.run(
        [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
         "-m", MARKERS, "tests/integration"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    log = report.with_suffix(".log")
    log.write_text(test.stdout + test.stderr)
    tail = "\n".join((test.stdout + test.stderr).rstrip().splitlines()[-25:])
    summary = (test.stdout.rstrip().splitlines() or ["(no output)"])[-1]
    report.write_text(
        f"# nbdist compat: {name}\n\n"
        f"{time.strftime('%Y-%m-%d')}, {pyver}; installed: {', '.join(versions)}\n\n"
        f'`pytest -m "{MARKERS}" tests/integration`: exit {test.returncode}, '
        f"{summary} (set-up {setup_s:.0f} s)\n\n```\n{tail}\n```\n"
    )
    print(report.read_text())
    return test.returncode


if __name__ == "__main__":
    sys.exit(main())
