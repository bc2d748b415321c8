"""``breakpoint()`` in a ``%%distrain`` cell: the rank pauses, the notebook prompts.

An engine runs one request at a time, and the cell is that request: nothing sent through
ipyparallel reaches it until the cell ends (its control channel takes signals, not data). So
the rank that hits a breakpoint connects to the notebook itself, over a Unix socket the kernel
listens on (:mod:`nbdist.kernel.breakpoints`), authenticated with a key that came with the
cell (``multiprocessing.connection``'s HMAC challenge, before anything is unpickled). A Unix
socket is a file: engines in the private network namespace reach it, other users cannot (its
folder is the kernel user's, mode 0700), and engines on another host do not see it; there the
breakpoint is said and skipped, as it was before.

The debugger is pdb with its interaction turned around: at each stop it sends what pdb printed
and its prompt, then runs the lines the notebook sends, one at a time. A line that lets the
program go on (``c``, ``n``, ``s``, ``r``) is answered "resumed"; the next stop (``n`` ends at
the next line) starts a new exchange on the same connection. ``q`` is the notebook's: it stops
the cell the way a Stop does, and the rank goes on to the step boundary.

Messages, rank to notebook: ``("stop", rank, text, prompt)``, ``("reply", text, prompt)``,
``("resumed", text)``; notebook to rank: a line of input.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from nbdist.engine.debugging import Debugger, cell_labels

SKIPPED = (
    "nbdist: breakpoint() at {where} does not stop a %%distrain cell here (the notebook's "
    "prompt reaches only workers on its own machine); the cell goes on. To look at the "
    "variables at that line: raise there (raise RuntimeError('look')), then %distrain debug."
)


class RemoteDebugger(Debugger):
    """pdb whose prompt is the notebook's: ``conn`` carries the exchange."""

    def __init__(self, conn: Any, rank: int) -> None:
        super().__init__(dict(cell_labels()))
        self.conn = conn
        self.rank = rank

    def interaction(self, frame: Any, traceback: Any) -> None:
        if self.setup(frame, traceback):  # type: ignore[func-returns-value]  # an rc's "c"
            self.forget()
            return
        self.print_stack_entry(self.stack[self.curindex])
        reply = self.reply()
        try:
            self.conn.send(("stop", self.rank, reply.text, reply.prompt))
            while True:
                line = self.conn.recv()
                if self.feed(line):
                    self.conn.send(("resumed", self.take_output()))
                    return
                reply = self.reply()
                self.conn.send(("reply", reply.text, reply.prompt))
        except (EOFError, OSError):  # the notebook is gone: the cell goes on without it
            self.set_continue()
        finally:
            self.forget()


@contextlib.contextmanager
def breakpoints(rank: int, channel: tuple[str, bytes] | None) -> Iterator[None]:
    """While a cell runs, ``breakpoint()`` prompts in the notebook through ``channel`` (the
    kernel's socket and key); where that socket is not on this machine, or no channel came
    with the cell, the breakpoint is said once per line and the cell goes on."""
    said: set[tuple[str, int]] = set()
    conn: Any = None
    labels = cell_labels()

    def hook(*args: object, **kwargs: object) -> None:
        nonlocal conn
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return
        caller = sys._getframe(1)
        if conn is None and channel is not None and os.path.exists(channel[0]):
            from multiprocessing.connection import Client

            try:
                conn = Client(channel[0], family="AF_UNIX", authkey=channel[1])
            except OSError:
                conn = None
        if conn is not None:
            RemoteDebugger(conn, rank).set_trace(caller)
            return
        at = (caller.f_code.co_filename, caller.f_lineno)
        if at not in said:
            said.add(at)
            where = f"{labels.get(at[0], at[0])}, line {at[1]}"
            print(SKIPPED.format(where=where), file=sys.stderr, flush=True)

    saved, sys.breakpointhook = sys.breakpointhook, hook
    try:
        yield
    finally:
        sys.breakpointhook = saved
        if conn is not None:
            sys.settrace(None)  # a debugger still tracing (`n` at the cell's last line) ends
            conn.close()
