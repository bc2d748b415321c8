"""The entry points the notebook calls on each engine.

``run_rank`` runs one rank of a ``%%distrain`` cell: it applies the rank's environment in a
context that restores it, lets the backend make the distributed runtime ready, and runs the cell
in the engine's persistent namespace (:mod:`nbdist.engine.namespace`) with the context names
set. It never raises: a failure comes back as data (rank, host, exception, cell line, traceback)
so that the notebook can merge the reports of all ranks into one error.

After a failure the notebook decides what becomes of the session (see
``nbdist.kernel.failures``): it asks every rank whether the group still works
(:func:`check_group`), and when it does not, has every rank drop its variables and its part of
the group (:func:`drop_session`), in that order: destroying a gloo group under a live DDP model
can deadlock.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nbdist.engine import backends, breakpoints, debugging, display, healing, profiling, stopping
from nbdist.engine.env import interrupts_kept, patch_environment, sigint_ignored
from nbdist.engine.hardware import process_info, reachable_address
from nbdist.engine.metrics import Recorder, flush_interval
from nbdist.engine.namespace import clear, free_memory, session_namespace, user_variables
from nbdist.engine.state import engine_state
from nbdist.engine.waiting import WhereReporter
from nbdist.protocol import (
    STOPPING_KEY,
    EngineReport,
    Packed,
    Prepared,
    RankFailure,
    RankReport,
    RankSpec,
    UnpackError,
)

__all__ = [
    "check_group",
    "join_group",
    "drop_session",
    "engine_info",
    "use_gpus",
    "prepare",
    "run_rank",
    "run_source",
    "set_address",
    "warm_up",
]


def use_gpus(visible: str, index: int | None) -> None:
    """Before any framework touches CUDA: the GPUs this engine sees (``CUDA_VISIBLE_DEVICES``;
    "" hides them all), and the one it uses, ``cuda:<index>`` (None: the CPU)."""
    state = engine_state()
    state.cuda_index = index
    os.environ["CUDA_VISIBLE_DEVICES"] = visible


def engine_info(peer: str | None = None) -> EngineReport:
    """Identity and hardware of this engine; gathered once per engine.

    ``peer`` is the controller's address: with it, the engine also finds (and keeps) the address
    other hosts reach it at (see :func:`nbdist.engine.hardware.reachable_address`).
    """
    state = engine_state()
    if peer is not None:
        state.address = reachable_address(peer)
    notebook_folder_last()
    return process_info(state.address)


def notebook_folder_last() -> None:
    """The engine's working folder (the notebook's) last on ``sys.path``, not first, where the
    engine's IPython put it: a ``profile.py`` there would hide the standard library's from the
    imports a cell's framework makes. The folder's own modules still import."""
    folder = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", folder)]
    sys.path.append(folder)


def set_address(address: str) -> None:
    """The address other hosts reach this engine at, as the notebook settled it."""
    engine_state().address = address


def warm_up(framework: str, *, local_world_size: int, cpus: int) -> float:
    """Import ``framework`` and size its thread pools, once per engine; returns seconds taken."""
    state = engine_state()
    start = time.perf_counter()
    if framework not in state.warm:
        backends.load(framework).warm_up(local_world_size=local_world_size, cpus=cpus)
        state.warm.add(framework)
    return time.perf_counter() - start


def prepare(framework: str, *, rank: int, world_size: int, options: dict[str, Any]) -> Prepared:
    """This engine's part of a new rendezvous for ``framework``."""
    return backends.load(framework).prepare(
        rank=rank, world_size=world_size, options=options, state=engine_state()
    )


def _split_last_expression(tree: ast.Module) -> tuple[ast.Module, ast.Expression | None]:
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        return ast.Module(tree.body[:-1], type_ignores=[]), last
    return tree, None


def run_source(source: str, filename: str, namespace: dict[str, Any], first_line: int = 1) -> Any:
    """Run the cell like IPython does: statements, then the value of a final expression.
    ``first_line``: the editor's line number of the source's first line, which tracebacks,
    failures and where a rank waits then count from."""
    # Register the source so tracebacks show the cell's lines, at the editor's line numbers.
    lines = ["\n"] * (first_line - 1) + source.splitlines(True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    tree = ast.parse(source, filename)
    ast.increment_lineno(tree, first_line - 1)
    body, last = _split_last_expression(tree)
    exec(compile(body, filename, "exec"), namespace)
    if last is not None:
        return eval(compile(last, filename, "eval"), namespace)
    return None


def _from_cell(exc: BaseException, filename: str) -> Any:
    """``exc``'s traceback from the cell's frame down: the worker's own frames are noise to
    the user (all of it where the cell is not on it)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return exc.__traceback__ if tb is None else tb


def _describe(exc: BaseException, spec: RankSpec, host: str) -> RankFailure:
    """A picklable report of ``exc``: type, message, cell line and the traceback from the cell."""
    tb = _from_cell(exc, spec.filename)
    line = None
    walk = tb
    while walk is not None:
        if walk.tb_frame.f_code.co_filename == spec.filename:
            line = walk.tb_lineno
        walk = walk.tb_next
    text = relabel("".join(traceback.format_exception(type(exc), exc, tb)))
    line_text = linecache.getline(spec.filename, line) if line else ""
    headline = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # The frames stay for %distrain debug until the next cell (their variables with them).
    debugging.keep(tb, headline, spec.cell.label)
    return RankFailure(
        rank=spec.rank,
        host=host,
        exc_type=type(exc).__name__,
        message=str(exc),
        traceback=text,
        line=line,
        line_text=line_text.rstrip("\n"),
        time=time.time(),
        cell=spec.cell.label,
        pid=os.getpid(),
    )


def relabel(text: str) -> str:
    """A traceback's frames in the session's cells named as IPython names them:
    ``Cell In[12], line 9, in train`` for ``File "<nbdist cell 4>", line 9, in train``."""
    labels = engine_state().cell_labels

    def name(m: re.Match[str]) -> str:
        label = labels.get(m.group(1))
        return m.group(0) if label is None else f"{label}, line {m.group(2)}"

    return re.sub(r'File "(<nbdist cell \d+>)", line (\d+)', name, text)


def run_rank(spec: RankSpec) -> RankReport:
    """Run one rank of a cell; returns its report (never raises)."""
    state = engine_state()
    debugging.forget()  # the last failure's frames: kept until the next cell
    backend = backends.load(spec.framework)
    host = socket.gethostname()
    start = time.perf_counter()
    namespace: dict[str, Any] = {"__name__": "__main__"} if spec.fresh else session_namespace()
    report = RankReport(rank=spec.rank, host=host, pid=os.getpid())
    state.cell_labels[spec.filename] = spec.cell.label  # for tracebacks, in later cells too
    publish = _publisher()
    recorder = Recorder(publish, autolog=spec.autolog, flush_s=flush_interval(spec.world_size))
    recorder.start()
    where = WhereReporter(publish, spec.filename)
    where.start()
    state.recorder = recorder
    try:
        with patch_environment(spec.env), backend.session(spec, state) as names:
            # What a healing (or a rebuilt group) left for the new group.
            healing.rewrap(session_namespace(), names, spec.framework)
            namespace.update(names)
            namespace.update(
                log=recorder,
                rank=spec.rank,
                world_size=spec.world_size,
                local_rank=spec.local_rank,
                local_world_size=spec.local_world_size,
                is_main=spec.rank == 0,
            )
            if spec.push is not None:
                namespace.update(_pushed(spec.push))
            display.set_up(state)
            stopping.begin(_stopper(spec, state, backend, publish))
            with (
                interrupts_kept(),
                _exits_end_the_cell(namespace),
                display.cell_figures(),
                breakpoints.breakpoints(spec.rank, spec.debug),
            ):
                value = run_source(spec.source, spec.filename, namespace, spec.cell.first_line)
            report.value = display.packed(value)
            report.value_repr = None if value is None else _repr(value)
            del value
            try:  # the cell itself succeeded: a wrong --pull name must not fail the rank
                report.pulled = _pull(namespace, spec.pull, spec.rank) if spec.pull else None
            except _PullError as e:
                report.pull_error = str(e)
    except stopping.StopAtStep as stop:  # a graceful stop: the cell ends, the session stays
        report.stopped_at = stop.step
        debugging.stopped(_from_cell(stop, spec.filename), stop.step)
    except BaseException as exc:  # noqa: B036 - an interrupt must be reported like any failure
        report.failure = _describe(exc, spec, host)
    finally:
        stopping.end()
        with sigint_ignored():
            where.close()
            state.recorder = None
            recorder.close()
            if spec.fresh:
                namespace.clear()
            # No flush of stdout and stderr here: ipyparallel's apply_request flushes both
            # after this returns and before it sends the reply (each flush waits for the IO
            # thread: two more of them cost a short cell 0.4 ms).
    if spec.profile:
        report.profile = profiling.take()
    report.names = [] if spec.fresh else sorted(user_variables(namespace))
    report.messages = recorder.messages
    report.steps, report.collectives = recorder.steps, recorder.collectives
    report.libraries = training_libraries()
    report.wall = time.perf_counter() - start
    return report


def _stopper(spec: RankSpec, state: Any, backend: Any, publish: Any) -> stopping.Stopper | None:
    """This rank's part in a graceful stop of the run, where the backend has a board; the
    step it agrees on is told to the notebook (the panel shows it)."""
    board = backend.stop_board(spec, state)
    if board is None:
        return None
    ranks = list(spec.ranks) or list(range(spec.world_size))
    return stopping.Stopper(
        board, spec.rank, ranks, announce=lambda step: publish({STOPPING_KEY: step})
    )


def join_group(spec: RankSpec) -> None:
    """Take part in setting up the group (or strategy) without running the cell: the ranks an
    ``--on`` cell leaves out do this, since the set-up needs every rank."""
    state = engine_state()
    with patch_environment(spec.env), backends.load(spec.framework).session(spec, state) as names:
        healing.rewrap(session_namespace(), names, spec.framework)


def check_group(framework: str, *, timeout: float) -> str | None:
    """Whether this rank's part of the group still works after a failed cell: None if it does,
    else why not. Returns within about ``timeout`` seconds."""
    return backends.load(framework).healthy(engine_state(), timeout=timeout)


def drop_session(framework: str) -> list[str]:
    """Drop the cells' variables, then this rank's part of the group; returns the names dropped.

    Destroying the group closes this rank's connections, which frees peers still blocked in a
    collective with it within about a second (SIGINT does not).
    """
    with sigint_ignored():
        dropped = clear(session_namespace())
        engine_state().slot(healing.SLOT).clear()  # nothing left for a healing to wrap again
        free_memory()
        backends.load(framework).recover(engine_state())
    return dropped


def release(framework: str) -> tuple[bool, list[str], list[str]]:
    """Leave the group, keeping this rank's variables (``healing.leave_group``): how peers
    blocked in a collective with it are freed, and how the group is rebuilt after an error.
    Returns whether they were kept, the names dropped, and the sharded ones that made it drop
    them: sharded state (FSDP2, DTensors) cannot be rebuilt on a new group, and its device
    mesh holds the group open (destroying the group then freed nobody), so it is dropped, as
    drop_session does."""
    split = healing.sharded()
    if split:
        return False, drop_session(framework), split
    healing.leave_group(framework)
    return True, [], []


class _EndCell:
    """``exit()`` and ``quit()`` inside a cell: end the cell on this rank, as ``sys.exit()``
    does (``SystemExit``, reported like any error), and keep the worker.

    IPython's own ``exit`` in an engine asks the engine to shut down once the task is over:
    the cell carried on to its end, reported success, and then every engine that ran it was
    gone, with the session's variables. A script's "no GPU: exit()" means "stop here".
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() or sys.exit() to end this %%distrain cell on this rank"

    def __call__(self, code: Any = None) -> None:
        raise SystemExit() if code is None else SystemExit(code)


@contextmanager
def _exits_end_the_cell(namespace: dict[str, Any]) -> Iterator[None]:
    """``exit`` and ``quit`` are :class:`_EndCell` while the cell runs (IPython's after it)."""
    saved = {name: namespace.get(name, _MISSING) for name in ("exit", "quit")}
    namespace.update({name: _EndCell(name) for name in saved})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                namespace.pop(name, None)
            else:
                namespace[name] = value


_MISSING = object()


# Libraries that run a training loop of their own, by the module that names their version.
TRAINING_LIBRARIES = ("transformers", "accelerate", "lightning", "pytorch_lightning", "keras")


def training_libraries() -> dict[str, str]:
    """The training libraries this engine has loaded, with their versions (never imported
    here)."""
    out = {}
    for name in TRAINING_LIBRARIES:
        module = sys.modules.get(name)
        if module is not None:
            out[name] = str(getattr(module, "__version__", "?"))
    return out


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as e:  # a broken __repr__ must not fail the cell that computed the value
        return f"<{type(value).__name__} object (repr failed: {type(e).__name__})>"


def _publisher() -> Any:
    """ipyparallel's ``publish_data``: this engine's data channel to the notebook, for the
    threads that share it (the cell's, the metrics flusher, the place sampler): one message at a
    time, since a zmq socket is not thread-safe."""
    from ipyparallel.engine.datapub import publish_data

    lock = threading.Lock()

    def publish(data: dict[str, Any]) -> None:
        with lock:
            publish_data(data)

    return publish


def _pushed(push: Packed) -> dict[str, Any]:
    """``--push``'s values, rebuilt on this engine (a failure is the rank's, named)."""
    try:
        return push.unpack(" on this worker")
    except UnpackError as e:
        raise UnpackError(f"--push {e}") from None


class _PullError(Exception):
    pass


def _pull(namespace: dict[str, Any], names: tuple[str, ...], rank: int) -> Packed:
    from nbdist.engine.session_ops import pull

    try:
        return pull(list(names), namespace)
    except (NameError, TypeError) as e:
        raise _PullError(f"--pull: {e} (rank {rank})") from None
