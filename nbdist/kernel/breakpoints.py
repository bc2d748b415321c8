"""The notebook's end of ``breakpoint()`` in a ``%%distrain`` cell (the engine's end, and why
it connects to the notebook, is :mod:`nbdist.engine.breakpoints`).

:class:`Desk` is a Unix socket in a folder of the kernel user's own (mode 0700, in nbdist's run
folder, removed by the reaper when the kernel dies without closing it), opened at the
first cell and kept for the session; a thread accepts the ranks that connect (each proves the
session's key first). While a cell runs, the watch loop asks :meth:`Desk.serve` to take what
the ranks sent: a rank that stopped is prompted for in the notebook's input box, ``(rank 1)
Pdb``, and each line typed goes to that rank's pdb. Two ranks at a breakpoint are taken one
after the other, the lowest rank first. ``q`` (or the Stop button at the prompt) asks the
cell to stop the way Stop does, and lets the rank go on to its step boundary.
"""

from __future__ import annotations

import atexit
import builtins
import os
import queue
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, wait
from typing import cast

from IPython.core.error import StdinNotImplementedError

from nbdist.errors import ClusterError
from nbdist.kernel.runfiles import kernel_folder

QUIT = ("q", "quit", "exit")
NO_INPUT = (
    "nbdist: rank {rank} stopped at a breakpoint, and this front end has no input box for "
    "the debugger's prompt: the ranks go on past their breakpoints in this cell (c). Run the "
    "notebook in JupyterLab, Notebook 7 or VS Code to type pdb commands there."
)


class Desk:
    """Where ranks at a breakpoint reach the notebook (see the module docstring)."""

    def __init__(self) -> None:
        self.authkey = os.urandom(32)
        self._folder: str | None = None
        self._listener: Listener | None = None
        self._arrived: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._conns: list[Connection] = []
        self._rank: dict[Connection, int] = {}  # each connection's rank
        self._prompts: dict[Connection, str] = {}  # at a prompt: pdb's mode ("Pdb ", ">>> ")
        self._waiting: set[Connection] = set()  # a line sent, its answer not yet come
        # The rank whose debugger the notebook is in, from its prompt until it goes on (c, n,
        # s, q): another rank that stops meanwhile waits its turn, even a lower one. (Not past
        # an n: the line run may be a collective that waits for a rank at its breakpoint.)
        self._current: Connection | None = None
        self._no_input = False  # this front end has no input box: said once, ranks go on

    def channel(self) -> tuple[str, bytes]:
        """The socket's path and the key, for the cell's ranks (opened on first use)."""
        if self._listener is None:
            try:
                self._folder = str(kernel_folder("bp"))  # 0700, in the user's 0700 run folder
            except ClusterError:  # no private run folder (a connected cluster needs none)
                self._folder = tempfile.mkdtemp(prefix="nbdist-bp-")
            path = os.path.join(self._folder, "s")
            self._listener = Listener(path, family="AF_UNIX", authkey=self.authkey)
            threading.Thread(target=self._accept, name="nbdist-breakpoints", daemon=True).start()
            atexit.register(self.close)
        return (self._listener.address, self.authkey)

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                self._arrived.put(listener.accept())
            except OSError:  # closed
                return
            except Exception:  # noqa: S112, BLE001 - a connection that failed the key: refused
                continue

    @property
    def active(self) -> bool:
        """A rank is paused in the debugger (at the prompt, or running a line sent to it)."""
        return bool(self._prompts or self._waiting)

    def serve(
        self,
        out: Callable[[str], None],
        ask_stop: Callable[[], None],
        ask: Callable[[str], str] | None = None,
    ) -> None:
        """Take what the ranks sent; prompt for the rank the notebook is with, else the lowest
        at a prompt, and send it the line typed. Returns at once when no rank is at a
        breakpoint, or when the rank it is with still runs the line it was sent."""
        while True:
            try:
                self._conns.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        if not self._conns:
            return
        for ready in wait(self._conns, timeout=0):
            self._take(cast(Connection, ready), out)
        if not self._prompts:
            return
        if self._current is not None and self._current not in self._prompts:
            return  # its answer, and its next prompt, come before another rank's turn
        conn = self._current or min(self._prompts, key=lambda c: self._rank[c])
        self._current = conn
        rank, mode = self._rank[conn], self._prompts.pop(conn)
        line = self._read(f"(rank {rank}) {mode}", rank, out, ask)
        if line.strip() in QUIT and mode == "Pdb ":
            out(f"nbdist: stopping the cell at the next step boundary (rank {rank} goes on to it)")
            ask_stop()
            line = "c"
        try:
            conn.send(line)
            self._waiting.add(conn)
        except OSError:
            self._drop(conn)

    def _take(self, conn: Connection, out: Callable[[str], None]) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the rank's cell ended: its connection closed
            self._drop(conn)
            return
        self._waiting.discard(conn)
        kind, *rest = message
        if kind == "stop":
            self._rank[conn], text, self._prompts[conn] = rest
            if self._no_input:  # said once: the ranks go on past their breakpoints
                text = ""
        elif kind == "reply":
            text, self._prompts[conn] = rest
        else:  # "resumed": its turn is over
            text = "" if self._no_input else rest[0]
            if conn is self._current:
                self._current = None
        show(text, out)

    def _read(
        self,
        prompt: str,
        rank: int,
        out: Callable[[str], None],
        ask: Callable[[str], str] | None,
    ) -> str:
        """A line from the notebook's input box. The Stop button there is ``q``; a front end
        without an input box lets the rank go on."""
        if self._no_input:
            return "c"
        ask = ask or builtins.input
        # The watch loop counts interrupts instead of raising them: at the prompt, the Stop
        # button must reach the input box.
        saved = signal.getsignal(signal.SIGINT)
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:  # not the main thread
            saved = None
        try:
            return ask(prompt)
        except (StdinNotImplementedError, OSError):  # OSError: a stdin that cannot be read
            out(NO_INPUT.format(rank=rank))
            self._no_input = True
            return "c"
        except (KeyboardInterrupt, EOFError):
            return "q"
        finally:
            if saved is not None:
                signal.signal(signal.SIGINT, saved)

    def _drop(self, conn: Connection) -> None:
        if conn is self._current:
            self._current = None
        self._prompts.pop(conn, None)
        self._rank.pop(conn, None)
        self._waiting.discard(conn)
        if conn in self._conns:
            self._conns.remove(conn)
        conn.close()

    def end_cell(self) -> None:
        """The cell ended: what its ranks left (a last "resumed", their closed ends) is
        dropped, and the next cell starts with none at a prompt."""
        for conn in list(self._conns):
            self._drop(conn)
        self._no_input = False  # the next cell asks again
        while True:
            try:
                self._arrived.get_nowait().close()
            except queue.Empty:
                break

    def close(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def show(text: str, out: Callable[[str], None]) -> None:
    """What a rank's pdb printed, without its last newline; nothing when it printed nothing."""
    text = text.rstrip("\n")
    if text:
        out(text)


__all__ = ["Desk", "show"]
