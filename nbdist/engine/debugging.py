"""``%distrain debug``: a pdb post-mortem on the frames of this rank's last failed cell.

When a rank's cell raises, :func:`keep` holds its traceback (from the cell's frame down, the
frames' variables with it) until the next cell starts on this engine, as IPython keeps
``sys.last_traceback`` for ``%debug``. An engine has no terminal, so the notebook drives the
debugger one line at a time: :func:`open_debugger` starts a :class:`pdb.Pdb` at the frame that
raised and :func:`command` runs one line of input and returns what pdb printed. pdb's
``interact`` becomes an interactive console fed the same way (``exit()`` goes back to pdb).

A DDP model that only the kept frames hold (one a function made for itself) must not outlive
its process group: destroying a gloo group under a live DDP model can deadlock (see
``torch_ddp._teardown``). :func:`before_group_destroy` lets the frames go in that case, and
the next ``%distrain debug`` says why.
"""

from __future__ import annotations

import code
import contextlib
import io
import os
import pdb
import re
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType

from nbdist.protocol import DebugReply, ddp_type

_CELL_NAME = re.compile(r"<nbdist cell \d+>")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass
class _Kept:
    tb: TracebackType  # from the cell's frame down
    headline: str  # "ValueError: bad batch"
    cell: str  # the cell's label as the notebook shows it (Cell In[12])


_kept: _Kept | None = None
# How the last cell ended on this rank, and its stack then, for %distrain where: a failure's,
# or a graceful stop's (whose frames are not kept: the cell ended as it should).
_stack: tuple[str, traceback.StackSummary] | None = None
_let_go: str | None = None  # why the last failure's frames are gone, if they went early
_debugger: Debugger | None = None


def keep(tb: TracebackType, headline: str, cell: str) -> None:
    """Hold ``tb`` (a failed cell's traceback from its own frame down) for a post-mortem."""
    global _kept, _let_go, _stack
    close()
    _kept, _let_go = _Kept(tb, headline, cell), None
    _stack = (f"raised {headline}", traceback.extract_tb(tb))


def stopped(tb: TracebackType, step: int) -> None:
    """The cell stopped at a step boundary (a Stop): where each rank was, for ``where``."""
    global _stack
    _stack = (f"stopped at a step boundary ({step} steps taken)", traceback.extract_tb(tb))


def forget() -> None:
    """A new cell starts on this engine: the last failure's frames are let go."""
    global _kept, _let_go, _stack
    close()
    _kept, _let_go, _stack = None, None, None


def held() -> str | None:
    """The kept failure's headline, or None when this engine holds none."""
    return None if _kept is None else _kept.headline


def cell_labels() -> dict[str, str]:
    from nbdist.engine.state import engine_state

    return engine_state().cell_labels


LIBRARY_FRAMES = 6  # below the cell's own frames, the innermost ones shown by ``where``


def where() -> str | None:
    """How this rank's last cell ended and its stack then, the cell's own lines first (the
    innermost library frames after them); None when the last cell ended normally."""
    if _stack is None:
        return None
    how, stack = _stack
    labels = cell_labels()
    cell = [f for f in stack if f.filename in labels]
    lines = [how]
    lines += [
        f"  {labels[f.filename]}, line {f.lineno}, in {f.name}: {(f.line or '').strip()}"
        for f in cell
    ]
    last = max((i for i, f in enumerate(stack) if f.filename in labels), default=-1)
    # nbdist's own frames (its stop at a step boundary, its hooks) are not the user's code.
    inner = [f for f in list(stack)[last + 1 :] if not f.filename.startswith(_PACKAGE)]
    if len(inner) > LIBRARY_FRAMES:
        lines.append(f"  ... {len(inner) - LIBRARY_FRAMES} more frames, then")
        inner = inner[-LIBRARY_FRAMES:]
    lines += [f"    {_short(f.filename)}:{f.lineno}, in {f.name}" for f in inner]
    return "\n".join(lines)


def _short(filename: str) -> str:
    """``torch/distributed/distributed_c10d.py`` for a file in site-packages (or the stdlib)."""
    for mark in ("site-packages/", "dist-packages/", "/lib/python"):
        if mark in filename:
            rest = filename.split(mark, 1)[1]
            return rest.split("/", 1)[1] if mark == "/lib/python" and "/" in rest else rest
    return filename


def before_group_destroy() -> None:
    """Let the kept frames go if a DDP model is still alive when the group is destroyed
    (the frames may be what holds it; a DDP model alive at the destroy can deadlock)."""
    global _kept, _let_go
    ddp = ddp_type()
    if _kept is None or ddp is None:
        return
    import gc

    gc.collect()
    if any(isinstance(o, ddp) for o in gc.get_objects()):
        close()
        _kept = None
        _let_go = (
            "its frames held a DistributedDataParallel model when the process group was "
            "rebuilt after the failure, and were let go then (a DDP model alive while its "
            "group is destroyed can deadlock)"
        )
        gc.collect()


class _Leave:
    """``exit()`` / ``quit()`` in the console: back to pdb (the cell's own ``exit`` ends a
    cell, and the engine's builtin one would end the engine)."""

    def __repr__(self) -> str:
        return "Use exit() to go back to pdb"

    def __call__(self, code: object = None) -> None:
        raise SystemExit(code)


class _Console(code.InteractiveConsole):
    """pdb's ``interact``, its errors written where its output goes (the engine's excepthook
    would send them to the engine's own stream)."""

    def __init__(self, ns: dict[str, object], out: io.StringIO) -> None:
        ns["exit"] = ns["quit"] = _Leave()
        super().__init__(ns)
        self.out = out

    def write(self, data: str) -> None:
        self.out.write(data)

    def showtraceback(self) -> None:
        kind, value, tb = sys.exc_info()
        if isinstance(value, SystemExit):
            raise value
        # Without this module's and code.py's frames: the user's line is what matters.
        self.write("".join(traceback.format_exception(kind, value, tb.tb_next if tb else None)))

    def showsyntaxerror(self, filename: str | None = None) -> None:
        kind, value, _ = sys.exc_info()
        self.write("".join(traceback.format_exception_only(kind, value)))


class Debugger(pdb.Pdb):
    """pdb with its output captured, fed one line at a time."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.out = io.StringIO()
        super().__init__(stdin=io.StringIO(""), stdout=self.out, nosigint=True, readrc=False)
        self.use_rawinput = False  # (and no .pdbrc: the engine's host's is not the user's)
        self.console: _Console | None = None
        self.labels = labels
        self.more = False  # the console waits for the rest of a statement

    def do_interact(self, arg: str) -> None:  # pdb's reads a terminal the engine lacks
        assert self.curframe is not None  # pdb is at a frame whenever it takes a command
        ns = {**self.curframe.f_globals, **self.curframe_locals}
        self.console = _Console(ns, self.out)
        self.message("*interactive* (exit() goes back to pdb)")

    def feed(self, line: str) -> bool:
        """Run one line of input; True when it ends the debugger."""
        with contextlib.redirect_stdout(self.out), contextlib.redirect_stderr(self.out):
            if self.console is not None:
                try:
                    self.more = self.console.push(line)
                except SystemExit:
                    self.console, self.more = None, False
                return False
            try:
                line = self.precmd(line)
                return bool(self.postcmd(self.onecmd(line), line))
            except Exception as e:  # a command's own error, e.g. `restart`: said, pdb goes on
                self.message(f"*** {type(e).__name__}: {e}")
                return False

    def take_output(self) -> str:
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        return _CELL_NAME.sub(lambda m: self.labels.get(m.group(0), m.group(0)), text)

    def reply(self, ended: bool = False) -> DebugReply:
        if ended:
            mode = "ended"
        elif self.console is not None:
            mode = "... " if self.more else ">>> "
        else:
            mode = "Pdb "
        return DebugReply(text=self.take_output(), prompt=mode, ended=ended)


def open_debugger() -> DebugReply:
    """Start a post-mortem at the frame that raised; its first lines name the failure and
    the frame. Without a kept failure, the reply ends at once and says why."""
    global _debugger
    close()
    if _kept is None:
        why = _let_go or (
            "this engine holds no failed cell's frames (none failed here, or a cell ran since)"
        )
        return DebugReply(text=why, prompt="ended", ended=True)
    _debugger = Debugger(dict(cell_labels()))
    _debugger.reset()
    _debugger.setup(None, _kept.tb)
    _debugger.message(f"{_kept.cell}: {_kept.headline}")
    _debugger.print_stack_entry(_debugger.stack[_debugger.curindex])
    return _debugger.reply()


def command(line: str) -> DebugReply:
    """One line of the user's input to the open debugger."""
    if _debugger is None:
        return DebugReply(text="the debugger is not open", prompt="ended", ended=True)
    ended = _debugger.feed(line)
    reply = _debugger.reply(ended)
    if ended:
        close()
    return reply


def close() -> None:
    """End the debugger (the kept failure stays, for another ``%distrain debug``)."""
    global _debugger
    if _debugger is not None:
        _debugger.forget()
        _debugger = None


__all__ = [
    "before_group_destroy",
    "close",
    "command",
    "forget",
    "held",
    "keep",
    "open_debugger",
    "stopped",
    "where",
]
