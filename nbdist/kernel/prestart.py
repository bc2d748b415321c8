"""The workers started in the background at ``%load_ext nbdist``, while the user reads and types.

:class:`Prestart` runs :meth:`LocalCluster.launch` on a thread of its own. Its notices are held,
and its error too, for the first command that needs the cluster: :meth:`Prestart.finish` (in the
notebook's thread) waits for the launch, shows what it said, and attaches the notebook's client
(a client made in another thread lost the engines' printed output here). A Ctrl-C while it waits
cancels the launch and leaves no cluster, or the whole one if it had just finished. A kernel
that exits meanwhile stops what has started; ``%distrain connect`` cancels it.
"""

from __future__ import annotations

import threading
import time

from nbdist.engine.env import sigint_ignored
from nbdist.errors import ClusterError
from nbdist.kernel.local import LocalCluster, default_workers


class Prestart:
    """A background start of ``cluster``'s engines."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self._thread: threading.Thread | None = None
        # Its own cancel flag, read by that thread only: a start in the notebook's thread
        # after it never sees a cancel meant for it.
        self._cancel = threading.Event()
        self._done = threading.Event()  # set: the launch has ended
        self._held: list[str] = []
        self._error: BaseException | None = None
        self._launched: int | None = None  # engines launched, no client yet

    @property
    def pending(self) -> bool:
        """Begun, and not yet finished in the notebook's thread."""
        return self._thread is not None

    def begin(self, n: int | None = None) -> None:
        """Start the launch and return at once."""
        n = n or default_workers()
        self._thread = threading.Thread(
            target=self._run, args=(n,), name="nbdist-prestart", daemon=True
        )
        # Whoever stops the cluster meanwhile (an exit handler, %distrain stop) first stops
        # this launch at its next step and waits for it.
        self.cluster.before_stop = self._cancel_and_wait
        try:
            self._thread.start()
        except BaseException:  # no thread (can't start new thread): nothing runs, nothing waits
            self._thread = None
            self.cluster.before_stop = None
            raise

    def _run(self, n: int) -> None:
        try:
            self.cluster.launch(n, cancel=self._cancel, notify=self._held.append)
            self._launched = n
        except BaseException as e:  # noqa: B036 - held for the first command, raised there
            self._error = e
        finally:
            self._done.set()

    def finish(self, *, attach: bool = True) -> None:
        """Wait for the launch to end; show what it said (in the cell that waits), and attach
        the notebook's client to its engines (``attach``). Its error is held for
        :meth:`raise_error`.

        It waits on the launch's own ``done`` event, never in ``Thread.join`` or
        ``is_alive``: a Ctrl-C that interrupts those (CPython 3.11) releases the thread's state
        lock and marks it stopped while it still runs, and the start then ended after the cell
        had moved on.
        """
        if self._thread is None or self._thread is threading.current_thread():
            return
        try:
            while not self._done.is_set():
                time.sleep(0.05)
        except KeyboardInterrupt:
            self._cancel.set()  # it stops at its next step and stops what it started
            with sigint_ignored():
                self._done.wait()
                self._end(show=False)
                if self._launched is not None:  # launched before it saw the cancel
                    self._launched = None
                    self.cluster.stop(note=None)
            raise
        self._end(show=True)
        n, self._launched = self._launched, None
        if attach and n is not None and self._error is None:
            try:
                self.cluster.attach(n)
            except ClusterError as e:
                self._error = e

    def cancel(self) -> None:
        """Stop the launch at its next step (it stops what it started), and wait for it."""
        self._cancel.set()
        self.finish(attach=False)
        if self._launched is not None:
            self._launched = None
            self.cluster.stop(note=None)
        self._error = None

    def _cancel_and_wait(self) -> None:
        if self._thread is None or self._thread is threading.current_thread():
            return
        self._cancel.set()
        with sigint_ignored():
            self._done.wait()
        self._end(show=False)
        self._launched = None

    def _end(self, *, show: bool) -> None:
        self._thread = None
        self.cluster.before_stop = None
        held, self._held = self._held, []
        if isinstance(self._error, KeyboardInterrupt):  # cancelled: stopped already, silent
            self._error = None
            return
        if show:
            for message in held:
                self.cluster._notify(message)

    @property
    def error(self) -> BaseException | None:
        """Why the launch failed (None if it did not, or was never begun); waits for it."""
        self.finish()
        return self._error

    def raise_error(self) -> None:
        """The error of a launch that failed, once (then a plain start works)."""
        error = self.error
        self._error = None
        if error is not None:
            raise error
