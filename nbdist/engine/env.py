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
