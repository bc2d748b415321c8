"""Limits a JupyterHub's spawner sets on a student's server, for real: a kernel in a cgroup
whose CPU quota is one CPU of the machine's (``cpu_limit = 1``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster]

CPU_V1 = Path("/sys/fs/cgroup/cpu")

SCRIPT = textwrap.dedent(
    """
    import json
    from IPython.testing.globalipapp import start_ipython
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    ip.run_line_magic("distrain", "start -n 2")
    cluster = ip.magics_manager.registry["DistrainMagics"].cluster
    print("=== engines", json.dumps([e.cpus for e in cluster.engines]), flush=True)
    ip.run_line_magic("distrain", "stop")
    """
)


@contextmanager
def cgroup(hierarchy: Path, files: dict[str, str], what: str) -> Iterator[Path]:
    """A cgroup of v1's ``hierarchy`` (as this machine mounts it) with ``files`` written; the
    test skips, saying so, where none can be made (not root, another cgroup layout)."""
    folder = hierarchy / f"nbdist-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
    except OSError as e:
        pytest.skip(f"cannot make a cgroup with {what} here ({e}): needs root and cgroup v1's "
                    f"controller mounted at {hierarchy}")  # fmt: skip
    yield folder
    deadline = time.monotonic() + 10
    while True:
        try:
            folder.rmdir()
            return
        except OSError:  # an engine still exiting
            assert time.monotonic() < deadline, (folder / "cgroup.procs").read_text()
            time.sleep(0.1)


@pytest.fixture
def one_cpu():
    """A cgroup allowed 1 CPU's worth of time."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("a quota below the machine's count needs 2 CPUs or more")
    quota = {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}
    with cgroup(CPU_V1, quota, "a CPU quota") as folder:
        yield folder


def test_workers_count_the_cpus_a_quota_allows(one_cpu):
    def join() -> None:
        (one_cpu / "cgroup.procs").write_text(str(os.getpid()))

    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=180, preexec_fn=join,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout
    machine = os.cpu_count()
    assert (
        f"nbdist: 2 workers on the 1 CPU this kernel may use of the machine's {machine} (its "
        "cgroup's CPU quota is 1 CPU): they take turns, and every step waits for the slowest; "
        "-n 1 gives each worker a CPU of its own." in run.stdout.splitlines()
    ), run.stdout
    engines = run.stdout.split("=== engines ")[1].splitlines()[0]
    assert json.loads(engines) == [1, 1]  # each engine counts the CPU it may use


MEMORY_V1 = Path("/sys/fs/cgroup/memory")

TOO_MANY = textwrap.dedent(
    """
    import psutil
    from IPython.testing.globalipapp import start_ipython
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    limit = int(open(sys.argv[1] + "/memory.limit_in_bytes").read())
    used = int(open(sys.argv[1] + "/memory.usage_in_bytes").read())
    print("=== room", (limit - used) // 2**20, flush=True)
    try:
        ip.run_line_magic("distrain", "start -n 3")
    except Exception as e:
        print("=== refused", type(e).__name__, e, flush=True)
    print("=== children", len(psutil.Process().children(recursive=True)), flush=True)
    ip.run_line_magic("distrain", "start -n 1")
    cluster = ip.magics_manager.registry["DistrainMagics"].cluster
    print("=== started", len(cluster.engines), flush=True)
    print("=== resize", flush=True)
    ip.run_cell("%%distrain -n 3\\nx = 1\\n")  # a resize is checked too
    print("=== after", len(cluster.engines), flush=True)
    ip.run_line_magic("distrain", "stop")
    """
)


@pytest.fixture
def small_memory():
    """A memory cgroup whose limit leaves about 700 MB beyond what a fresh kernel uses: one
    torch worker fits, three do not."""
    with cgroup(MEMORY_V1, {"memory.limit_in_bytes": str(800 * 2**20)}, "a memory limit") as f:
        yield f


def test_a_memory_limit_too_small_for_the_workers_is_said_before_the_start(small_memory):
    def join() -> None:
        (small_memory / "cgroup.procs").write_text(str(os.getpid()))

    run = subprocess.run(
        [sys.executable, "-c", "import sys\n" + TOO_MANY, str(small_memory)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180,
        preexec_fn=join,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout
    parts = dict(p.split(None, 1) for p in run.stdout.split("=== ")[1:])
    room = int(parts["room"].split()[0])
    assert 600 < room < 800, run.stdout  # what a fresh kernel leaves of the 800 MB
    refused = parts["refused"].strip()
    said = re.fullmatch(
        r"ClusterError 3 workers need about 975 MB of memory \(325 MB each: an engine after a "
        r"first small torch cell, as measured on nbdist's test machine; training needs more\), "
        r"and this kernel's memory limit leaves (\d+) MB \(its cgroup allows 800 MB, (\d+) MB in "
        r"use\): fewer workers \(-n (\d)\)\. Ask for more memory \(a JupyterHub's mem_limit\), or "
        r"close other notebooks' kernels\.",
        refused,
    )
    assert said, refused
    left, used, fits = (int(g) for g in said.groups())
    assert left + used == 800 and fits == left // 325, refused  # the room it says, and who fits
    assert parts["children"].splitlines()[0] == "0"  # nothing was started
    assert parts["started"].splitlines()[0] == "1"
    resize = parts["resize"]
    assert "ClusterError: 3 workers need about 975 MB of memory (325 MB each" in resize, resize
    assert "resizing" not in resize, resize  # refused before the engines were replaced
    assert parts["after"].splitlines()[0] == "1"  # the running worker stays
