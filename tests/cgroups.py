"""A real memory cgroup with a limit, for the tests that need the kernel's out-of-memory
killer (tests/unit/test_oom.py, tests/integration/test_healing.py)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def memory_cgroup(mib: int) -> Iterator[Path]:
    """A new memory cgroup next to this process's, limited to ``mib`` MiB and no swap; move
    a process in by writing its PID to ``cgroup.procs``. Skips where this user cannot make one
    (root with cgroup v1 or v2 is needed)."""
    from nbdist.kernel.oom import memory_counter

    counter = memory_counter(os.getpid())
    if counter is None or not os.access(counter.parent, os.W_OK):
        pytest.skip("no writable memory cgroup here (root with cgroup v1 or v2 needed)")
    group = counter.parent / f"nbdist-oom-test-{os.getpid()}"
    group.mkdir()
    try:
        v1 = counter.name == "memory.oom_control"
        (group / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(mib << 20))
        if not v1:
            (group / "memory.swap.max").write_text("0")
        yield group
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                group.rmdir()
                break
            except OSError:  # its last process is still leaving
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
