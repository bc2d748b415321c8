"""Download into ``.whl/`` the wheels a bare GPU machine needs to run nbdist (``make gpu-wheels``).

The GPU machine we test on is offline and has Python 3.12 with a CUDA build of torch, pytest,
matplotlib, psutil, accelerate and pandas, and nothing of the notebook stack. This resolves
nbdist's notebook-side requirements for CPython 3.12 on manylinux x86_64 (wheels only), pinned to
the versions installed where this runs (the versions CI tests with), and keeps the wheels of
every package that machine does not already have (``ON_THE_BOX``). ``scripts/device_check.sh``
installs them there with ``pip install --no-index --no-deps --target``: with ``--no-deps``, the
packages left out here are the box's own.

    python scripts/gpu_wheels.py [--dest .whl]

Prints each wheel and the total, and fails when the total would not fit in one device run's
transfer (``LIMIT_MIB``: the whole working tree travels under 64 MiB).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What nbdist needs in the notebook kernel and on the engines, beyond the standard library.
NEEDED = (
    "cloudpickle",
    "ipyparallel",
    "ipython",
    "ipykernel",
    "jupyter_client",
    "pyzmq",
    "tornado",
    "traitlets",
    "ipywidgets",
)

# Already on the bare GPU machine: the packages it has (torch, pytest, matplotlib, psutil,
# accelerate, pandas) and their own requirements. Shipping one of these again would shadow the
# machine's copy (the install goes first on PYTHONPATH), so they stay out.
ON_THE_BOX = frozenset(
    {
        # torch
        "torch", "filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2",
        "markupsafe", "fsspec", "setuptools", "triton",
        # pytest
        "pytest", "iniconfig", "pluggy", "packaging", "pygments",
        # matplotlib
        "matplotlib", "numpy", "pillow", "pyparsing", "python-dateutil", "six", "kiwisolver",
        "cycler", "fonttools", "contourpy",
        # psutil; accelerate and huggingface_hub
        "psutil", "accelerate", "pyyaml", "safetensors", "huggingface-hub", "hf-xet", "tqdm",
        "requests", "certifi", "charset-normalizer", "idna", "urllib3",
        # pandas
        "pandas", "pytz", "tzdata",
    }
)  # fmt: skip

LIMIT_MIB = 48
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    """The distribution a wheel file holds (``pyzmq-27.3.0-cp312-abi3-....whl`` → ``pyzmq``)."""
    return normalize(filename.split("-", 1)[0])


def requirements() -> list[str]:
    """``NEEDED``, each pinned to the version installed here when there is one."""
    out = []
    for name in NEEDED:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def keep(files: list[str]) -> list[str]:
    """The wheels to ship: those of packages the GPU machine lacks."""
    return sorted(f for f in files if f.endswith(".whl") and wheel_name(f) not in ON_THE_BOX)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=ROOT / ".whl")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--dest", tmp,
            "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--abi", "cp312", *(f"--platform={p}" for p in PLATFORMS), *requirements(),
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
        files = keep(sorted(f.name for f in Path(tmp).iterdir()))
        a.dest.mkdir(parents=True, exist_ok=True)
        for old in a.dest.glob("*.whl"):
            old.unlink()
        for f in files:
            shutil.copy2(Path(tmp) / f, a.dest / f)
    total = 0
    for f in files:
        size = (a.dest / f).stat().st_size
        total += size
        print(f"{size / 2**20:7.2f} MiB  {f}")
    print(f"{total / 2**20:7.2f} MiB  in all, {len(files)} wheels in {a.dest}")
    if total > LIMIT_MIB * 2**20:
        print(
            f"gpu-wheels: {total / 2**20:.1f} MiB is over {LIMIT_MIB} MiB, too much for one device "
            "run (the working tree travels under 64 MiB); drop a package from NEEDED.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
