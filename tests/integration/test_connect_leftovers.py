"""Engines nbdist starts for a connected cluster (to heal it) are nbdist's to stop: nobody else
knows of them, ``ipcluster stop`` included. A kernel that connected, healed a rank and was then
killed (``kill -9``: no exit handler runs) leaves none of them behind: the reaper, a process of
its own, kills them. Real ``ipcluster start``, a real kernel process, a real SIGKILL."""

from __future__ import annotations

import ast
import os
import signal
import time

import psutil
import pytest

from tests.integration.test_connect_healing import CLUSTER_ID, launched  # noqa: F401 - fixture
from tests.kernel_proc import KernelProcess
from tests.procs import gone_or_zombie

pytestmark = [pytest.mark.cluster, pytest.mark.torch]


def _values(kernel: KernelProcess, cell: str) -> list:
    said = kernel.run(f"%%distrain --framework torch --no-plot -o res\n{cell}")
    assert said["error"] is None, said
    return ast.literal_eval(kernel.run("res.values")["value"])


def test_a_killed_kernel_leaves_no_engine_it_started_behind(launched):  # noqa: F811
    kernel = KernelProcess([])
    try:
        said = kernel.run(
            f"%distrain connect --profile-dir {launched} --cluster-id {CLUSTER_ID} --timeout 60 "
            "-n 3"
        )
        assert said["error"] is None, said
        before = _values(kernel, "import os\nme = os.getpid()\nme\n")  # a variable to heal
        os.kill(before[1], signal.SIGKILL)
        assert gone_or_zombie(before[1])
        deadline = time.monotonic() + 30  # the controller notices after 3 s of heartbeats
        while True:
            status = kernel.run("%distrain status")["out"]
            if "dead" in status:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        healed = kernel.run("%%distrain --no-plot -o res\nos.getpid()\n")  # healed first
        assert "the cluster's launcher (LocalEngineSetLauncher) started 1 new engine" in (
            healed["out"]
        ), healed
        after = ast.literal_eval(kernel.run("res.values")["value"])
        (started,) = set(after) - set(before)
        nanny = [c.pid for c in psutil.Process(started).children()]
        assert nanny
        kernel.proc.kill()
        kernel.proc.wait()
        assert all(gone_or_zombie(pid, timeout=10) for pid in [started, *nanny])
        # The engines ipcluster started are its own, and run on.
        assert psutil.pid_exists(before[0]) and psutil.pid_exists(before[2])
    finally:
        kernel.close()
