"""Environment changes that undo themselves: engines outlive every run."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def patch_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` and restore the previous state on exit.

    Variables that did not exist before are removed again; ones that did get their old value
    back, whether the block succeeded or raised.
    """
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update({key: str(value) for key, value in values.items()})
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Shield clean-up from a second interrupt: a half-done teardown would leave a hung group
    (on an engine) or processes behind (in the notebook). Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:  # an interrupt already pending fires on the line above; once.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def interrupts_kept() -> Iterator[None]:
    """A Ctrl-C that lands in a finalizer is delivered again, so the cell still stops.

    Python prints an exception raised in a ``__del__`` (or a weakref callback the garbage
    collector runs) as "Exception ignored in ..." and goes on; when that exception is the
    KeyboardInterrupt of an interrupt, the rank keeps running while its peers stopped. Seen in
    a Keras ``fit``: TensorFlow's ``AtomicFunction.__del__`` took the interrupt of one rank,
    which trained on into a collective its stopped peer never joined. Main thread only.

    The interrupt is raised again from another thread a moment later (raised in the main
    thread at once, it would land in the hook itself, and be ignored again); one still on its
    way when the block ends is raised as it ends.
    """
    import sys

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    redeliver = _Redelivery()
    previous = sys.unraisablehook

    def hook(unraisable: object) -> None:
        exc_type = getattr(unraisable, "exc_type", None)
        if (
            isinstance(exc_type, type)
            and issubclass(exc_type, KeyboardInterrupt)
            and threading.current_thread() is threading.main_thread()
        ):
            redeliver.soon()
            return
        previous(unraisable)  # type: ignore[arg-type]

    sys.unraisablehook = hook
    try:
        yield
    finally:
        on_its_way = redeliver.end()  # first: no delivery after this line, whatever comes next
        sys.unraisablehook = previous
        if on_its_way:
            raise KeyboardInterrupt


class _Redelivery:
    """An interrupt to raise in the main thread again, from a helper thread."""

    DELAY_S = 0.005  # the hook has returned by then

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = 0  # deliveries on their way
        self.ended = False  # set by the block's end: no delivery after it

    def soon(self) -> None:
        with self._lock:
            self._waiting += 1
        threading.Thread(target=self._deliver, name="nbdist-interrupt", daemon=True).start()

    def _deliver(self) -> None:
        import _thread
        import time

        time.sleep(self.DELAY_S)
        with self._lock:
            self._waiting -= 1
            if not self.ended:
                _thread.interrupt_main()  # raised at the next line the main thread runs

    def end(self) -> bool:
        """The block ends: no delivery after this. Returns whether one was still on its way
        (the block then raises it). One lock for both: a delivery that took the lock first has
        interrupted the main thread already; setting ``ended`` outside it let a delivery count
        itself done, then see ``ended`` and drop the interrupt, while the block saw none on its
        way (the interrupt was lost, once, on a loaded machine)."""
        with self._lock:
            self.ended = True
            return self._waiting > 0
