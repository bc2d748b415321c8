"""Processes a test started, and a check that none is left."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psutil


def _children() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


@contextmanager
def no_process_left() -> Iterator[None]:
    """Every process started inside the block is gone at its end."""
    before = set(_children())
    yield
    new = [p for pid, p in _children().items() if pid not in before]
    _, alive = psutil.wait_procs(new, timeout=10)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
