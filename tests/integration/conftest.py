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
