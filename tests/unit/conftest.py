"""Fixtures of the unit tests."""

from __future__ import annotations

import psutil
import pytest

from nbdist.kernel.magic import DistrainMagics


@pytest.fixture
def stopped(shell):
    """A DistrainMagics of its own on the test shell: its cluster has never started, whatever
    other test files did with the session-wide one. Yields it and a check that no process was
    started meanwhile."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    magics = DistrainMagics(shell)

    def nothing_started():
        assert not magics.cluster.running
        started = {p.pid for p in psutil.Process().children(recursive=True)} - before
        assert not started, f"processes started: {started}"

    yield magics, nothing_started
    magics.close()
