"""The suite's own set-up: importing its conftest changes no environment."""

import os
import subprocess
import sys
from pathlib import Path


def test_importing_the_conftest_leaves_the_environment_alone():
    conftest = Path(__file__).resolve().parents[1] / "conftest.py"
    code = (
        "import importlib.util, os, sys\n"
        "before = dict(os.environ)\n"
        f"spec = importlib.util.spec_from_file_location('c', {str(conftest)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(dict(os.environ) == before)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NBDIST_PRESTART"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "True", out.stderr
    assert os.environ["NBDIST_PRESTART"] == "0"  # set for the run, by pytest_configure
