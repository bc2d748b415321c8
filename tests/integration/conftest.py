"""Fixtures the integration modules share (the session-wide shell is in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_session(shell, magics):
    """Two warm torch workers with nothing in their namespaces."""
    shell.run_line_magic("distrain", "start -n 2")
    shell.run_cell_magic("distrain", "-n 2 --framework torch", "pass\n")
    shell.run_line_magic("distrain", "reset")
    return shell


@pytest.fixture(autouse=True)
def _no_dead_rank_carried_over(request):
    """After a test that leaves a rank dead (one that failed before its replacement), the
    workers are stopped: the next test then starts new ones, and fails only for itself (a CI
    run: test_export's reset found test_exits's dead rank)."""
    yield
    if "shell" not in request.fixturenames:
        return
    shell = request.getfixturevalue("shell")
    cluster = shell.magics_manager.registry["DistrainMagics"].cluster
    if cluster.running and cluster.engines and cluster.dead(range(cluster.size)):
        shell.run_line_magic("distrain", "stop")


@pytest.fixture(scope="module")
def ready(shell):
    """A 2-worker cluster with torch warmed up, shared by one module's tests."""
    shell.run_line_magic("distrain", "start -n 2")
    shell.run_cell_magic("distrain", "-n 2 --framework torch", "x = 1\n")
    return shell
