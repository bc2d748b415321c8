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


def test_sigint_interrupts_whatever_started_the_suite():
    """Started with SIGINT ignored (``make test &`` from a script, nohup), the suite still has
    Python's handler: the interrupt tests need it (and the engines they start inherit it)."""
    import signal

    here = Path(__file__).resolve()
    code = (
        "import signal, sys, pytest\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-o', 'addopts=', "
        f"{str(here)!r} + '::test_the_handler_is_pythons']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=here.parents[2]
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_handler_is_pythons():
    import signal

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
