"""One thread per engine for the periodic work of a running cell (metric flushes, stack samples).

A thread that publishes on the engine's iopub channel gets its own zmq socket from ipykernel
(one per thread), which ipykernel closes only every 10 s once the thread has ended. Threads
started afresh by every cell therefore hold a file descriptor or two per cell for up to 10 s,
and pay for a new thread and socket each time; the engine's one ticker thread pays once.

``every(period, fn)`` runs ``fn()`` every ``period`` seconds from that thread until the
returned :class:`Tick` is cancelled. ``Tick.cancel()`` returns once ``fn`` is not running and
will not run again, so a cell's clean-up knows nothing of it publishes afterwards.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable


class Tick:
    """One periodic task of the ticker; ``cancel()`` stops it for good."""

    def __init__(self, ticker: Ticker, period: float, fn: Callable[[], None]) -> None:
        self._ticker = ticker
        self.period = period
        self.fn = fn
        self.due = time.monotonic() + period
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True  # first: an interrupt while waiting below still stops it
        self._ticker.remove(self)


class Ticker:
    """Runs every task when it is due, one after the other, from one daemon thread."""

    def __init__(self) -> None:
        self._tasks: list[Tick] = []
        self._running = threading.Lock()  # held while a task runs, and to change the list
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def every(self, period: float, fn: Callable[[], None]) -> Tick:
        tick = Tick(self, period, fn)
        with self._running:
            self._tasks.append(tick)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="nbdist-ticker", daemon=True
                )
                self._thread.start()
        self._wake.set()
        return tick

    def remove(self, tick: Tick) -> None:
        with self._running:  # waits for a running task to end
            if tick in self._tasks:
                self._tasks.remove(tick)

    def _loop(self) -> None:
        while True:
            with self._running:
                self._wake.clear()  # a task added from here on sets it again
                now = time.monotonic()
                self._tasks = [t for t in self._tasks if not t.cancelled]
                for tick in [t for t in self._tasks if t.due <= now]:
                    if tick.cancelled:
                        continue
                    tick.due = now + tick.period
                    try:
                        tick.fn()
                    except Exception:  # a failing task must not stop the others
                        print("nbdist: a periodic task failed:", file=sys.__stderr__)
                        traceback.print_exc(file=sys.__stderr__)
                wait = min((t.due for t in self._tasks), default=now + 60.0) - time.monotonic()
            self._wake.wait(max(0.0, wait))


_TICKER = Ticker()


def every(period: float, fn: Callable[[], None]) -> Tick:
    """Run ``fn()`` every ``period`` seconds from the engine's ticker thread."""
    return _TICKER.every(period, fn)
