"""Telling the kernel's out-of-memory killer from a ``kill -9`` (nbdist.kernel.oom): a real
process in a real memory cgroup, killed by the real OOM killer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from nbdist.kernel import oom
from tests.cgroups import memory_cgroup

ALLOCATE = "import sys; sys.stdin.readline(); b = b'x' * (1 << 30); print(len(b))"


@pytest.fixture
def cgroup():
    with memory_cgroup(64) as group:
        yield group


def _start_in(group):
    proc = subprocess.Popen([sys.executable, "-c", ALLOCATE], stdin=subprocess.PIPE, text=True)
    (group / "cgroup.procs").write_text(str(proc.pid))
    return proc


@pytest.mark.parametrize("kernel_log", [True, False], ids=["kernel-log", "cgroup-count"])
def test_an_oom_kill_is_told_from_the_kernel_log_or_the_cgroup_count(
    cgroup, kernel_log, monkeypatch
):
    if not kernel_log:  # a user who may not read the kernel log (dmesg_restrict)
        monkeypatch.setattr(oom, "kernel_log_kill", lambda pid, since: None)
    proc = _start_in(cgroup)
    watch = oom.MemoryWatch()
    watch.note([proc.pid])
    proc.communicate("go\n", timeout=30)
    assert proc.returncode == -signal.SIGKILL
    cause = watch.cause(proc.pid)
    head = "the kernel's out-of-memory killer (memory limit 64 MiB) ("
    if kernel_log and oom.kernel_log_kill(proc.pid, 0.0) is None:
        pytest.skip("this user may not read the kernel log")
    if kernel_log:
        name = os.path.basename(sys.executable)[:15]  # the kernel's name of the process
        assert cause == (
            f"{head}kernel log: Memory cgroup out of memory: Killed process {proc.pid} ({name}))"
        ), cause
    else:
        assert cause == (
            f"{head}the OOM-kill count of its memory cgroup {oom._cgroup_name(cgroup / 'x')} "
            "rose from 0 to 1)"
        ), cause


def test_a_kill_9_is_not_called_out_of_memory(cgroup):
    proc = _start_in(cgroup)
    watch = oom.MemoryWatch()
    watch.note([proc.pid])
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert watch.cause(proc.pid) == ""
