"""A kernel that exits without %distrain stop leaves no ipyparallel process behind."""

import json
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = [pytest.mark.cluster]

SCRIPT = textwrap.dedent(
    """
    import json, psutil
    from IPython.testing.globalipapp import start_ipython
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    ip.run_line_magic("distrain", "start -n 2")
    me = psutil.Process()
    print(json.dumps([p.pid for p in me.children(recursive=True)]), flush=True)
    """
)


def test_no_process_left_after_kernel_exit():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    pids = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(pids) >= 3  # a controller and two engines
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)]
        if not alive:
            break
        time.sleep(0.1)
    assert alive == []


def test_no_process_left_after_kernel_is_killed():
    """nbval and forced Jupyter restarts SIGKILL the kernel: no atexit runs, the reaper acts."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT + "import time\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        while not line.startswith("["):
            line = proc.stdout.readline()
        pids = json.loads(line)
    finally:
        proc.kill()
        proc.wait()
    assert len(pids) >= 4  # a controller, two engines and the reaper
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            break
        time.sleep(0.1)
    assert alive == []
