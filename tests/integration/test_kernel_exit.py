"""A kernel that exits without %distrain stop leaves no ipyparallel process behind."""

import json
import os
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


AFTER_A_CELL = textwrap.dedent(
    """
    ip.run_cell_magic("distrain", "", "x = rank")
    print(json.dumps(ip.magics_manager.registry["DistrainMagics"].session.breakpoints.channel()[0]))
    import time
    time.sleep(600)
    """
)


def test_no_process_left_after_kernel_is_killed():
    """nbval and forced Jupyter restarts SIGKILL the kernel: no atexit runs, the reaper acts.
    It also removes the breakpoint socket's folder, which a cell opened."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT + AFTER_A_CELL], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        while not line.startswith("["):
            line = proc.stdout.readline()
        pids = json.loads(line)
        line = proc.stdout.readline()
        while not line.startswith('"'):
            line = proc.stdout.readline()
        socket = json.loads(line)
    finally:
        proc.kill()
        proc.wait()
    folder = os.path.dirname(socket)
    assert os.path.basename(folder).startswith(f"nbdist-{proc.pid}-")
    assert len(pids) >= 4  # a controller, two engines and the reaper
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive and not os.path.exists(folder):
            break
        time.sleep(0.1)
    assert alive == []
    assert not os.path.exists(folder)


KILLED_WHILE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from IPython.testing.globalipapp import start_ipython
    from nbdist.kernel.runfiles import run_dir

    # Unreadable and foreign run files must not stop the start.
    folder = run_dir()
    os.mkfifo(folder / "nbdist-1-fifo.pids")
    locked = folder / "nbdist-2-locked.pids"
    locked.write_text("{")
    locked.chmod(0)
    if os.geteuid() == 0:
        os.chown(locked, 4242, 4242)
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    if sys.argv[1] == "replacing":
        ip.run_line_magic("distrain", "start -n 2")
        print("up", flush=True)
        ip.magics_manager.registry["DistrainMagics"].cluster.replace_engines(2)
    else:
        ip.run_line_magic("distrain", "start -n 2")
    import time
    time.sleep(600)
    """
)


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _engines(root: psutil.Process) -> list[psutil.Process]:
    return [p for p in root.children(recursive=True) if "nbdist.engine.boot" in _cmdline(p)]


@pytest.mark.parametrize("moment", ["starting", "replacing"])
def test_kernel_killed_while_engines_start_leaves_nothing(tmp_path, moment):
    """SIGKILL the kernel as soon as engine processes exist, before they registered (a cold
    start, or a replacement of every engine): the reaper kills all, controller and holder too."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE, moment], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        kernel = psutil.Process(proc.pid)
        old: set[int] = set()
        if moment == "replacing":
            while proc.stdout.readline().strip() != "up":
                assert proc.poll() is None
            old = {p.pid for p in _engines(kernel)}
        deadline = time.monotonic() + 60
        while not [p for p in _engines(kernel) if p.pid not in old]:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        tree = kernel.children(recursive=True)
        cmds = " | ".join(_cmdline(p) for p in tree)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    for part in ("nbdist.engine.boot", "ipyparallel.controller", "nbdist/engine/netns.py"):
        assert part in cmds
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p.pid for p in tree if _alive(p)]
        if not alive:
            break
        time.sleep(0.1)
    assert alive == []
    # The reaper removed the record and the sockets folder; only the planted files remain.
    assert sorted(p.name for p in (tmp_path / "nbdist").iterdir()) == [
        "nbdist-1-fifo.pids",
        "nbdist-2-locked.pids",
    ]
