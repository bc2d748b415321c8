"""Processes a test started, and a check that none is left."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import psutil


def _children(root: int | None = None) -> dict[int, psutil.Process]:
    """The descendants of ``root`` (this process), from one pass over the process table by
    parent PID (no create-time filter: psutil's compares wall-clock times, which move when the
    clock is set)."""
    procs, kids = {}, {}
    for p in psutil.process_iter(["ppid"]):
        procs[p.pid] = p
        kids.setdefault(p.info["ppid"], []).append(p.pid)
    out, stack = {}, [os.getpid() if root is None else root]
    while stack:
        for pid in kids.get(stack.pop(), []):
            if pid not in out:
                out[pid] = procs[pid]
                stack.append(pid)
    return out


@contextmanager
def no_process_left(*, spare: int | None = None) -> Iterator[None]:
    """Every process started inside the block is gone at its end; ``spare``: a process started
    before it (a fixture's), whose children, forked meanwhile, are its own."""
    before = set(_children())
    yield
    theirs = set(_children(spare)) if spare is not None else set()
    new = [p for pid, p in _children().items() if pid not in before and pid not in theirs]
    _, alive = psutil.wait_procs(new, timeout=10)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def kill_now(pid: int) -> None:
    """SIGKILL process ``pid``, as a crash would end it, and wait until it is gone."""
    import signal

    os.kill(pid, signal.SIGKILL)
    assert gone_or_zombie(pid)


def gone_or_zombie(pid: int, timeout: float = 10.0) -> bool:
    """Wait until process ``pid`` is gone, or a zombie (dead, not yet reaped by its parent);
    whether it was within ``timeout`` seconds. A process reaped between two looks is gone."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def wait_until(ready, timeout: float = 60.0) -> bool:
    """Wait until ``ready()`` is true (the cell's ranks are where the test wants them: past a
    step, ignoring SIGINT, seen logging), or ``timeout`` seconds have passed; whether it was.
    A fixed delay instead would guess how fast the machine is."""
    import time

    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def once(ready, action, timeout: float = 60.0):
    """A started thread that calls ``action()`` once ``ready()`` is true, or after ``timeout``
    seconds (``wait_until``), so that a cell is never left running on its own."""
    import threading

    def wait_then_act() -> None:
        wait_until(ready, timeout)
        action()

    thread = threading.Thread(target=wait_then_act)
    thread.start()
    return thread


def once_written(paths, action, timeout: float = 60.0):
    """``once`` every file in ``paths`` exists (the cell's ranks write them)."""
    return once(lambda: all(p.exists() for p in paths), action, timeout)


def cell_started(folder, world: int):
    """A line to put first in a cell, which writes ``folder/running-{rank}`` on each rank, and
    the files of ranks 0..``world``-1: once they all exist, every rank runs the cell."""
    line = f"open({str(folder)!r} + f'/running-{{rank}}', 'w').close()\n"
    return line, [folder / f"running-{r}" for r in range(world)]
