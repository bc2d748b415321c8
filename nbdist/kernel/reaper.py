"""Kills the cluster's processes when the kernel that owns them dies without stopping them.

A kernel that is killed outright (nbval and Jupyter's forced restarts send SIGKILL) runs no
atexit handler, and its controller and engines would keep running, holding memory and GPUs. The
reaper is a small child process started with the cluster, in its own session so the kernel's
death does not take it along. It watches the kernel's PID; when the kernel is gone it kills the
process trees listed in the PID file. When the cluster is stopped normally the PID file is
removed and the reaper exits.

    python -m nbdist.kernel.reaper KERNEL_PID PIDFILE
"""

from __future__ import annotations

import os
import sys
import time

POLL_S = 0.5


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _read_pids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(tok) for tok in f.read().split()]
    except (OSError, ValueError):
        return []


def watch(kernel_pid: int, pidfile: str) -> None:
    import psutil

    while os.path.exists(pidfile):
        if not psutil.pid_exists(kernel_pid):
            for pid in _read_pids(pidfile):
                _kill_tree(pid)
            os.unlink(pidfile)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
