"""``%distrain debug [RANK] [-c COMMAND ...]``: pdb on the frames of a rank's failed cell.

The frames live on the engine that ran the rank (:mod:`nbdist.engine.debugging` keeps them
until the next cell). Here the notebook's own input box is the debugger's prompt: each line
typed goes to that rank's pdb, and what pdb prints comes back. Other ranks are not asked
anything, and the session (variables, group) goes on as it was. ``-c`` gives the commands
instead of the input box (front ends without one, and notebooks whose stored output is checked).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import StdinNotImplementedError, UsageError

from nbdist.engine import debugging
from nbdist.errors import WorkerError
from nbdist.kernel.breakpoints import show
from nbdist.kernel.engines import remote_message, reply

OPEN_TIMEOUT_S = 30.0
POLL_S = 0.5


@dataclass(frozen=True)
class FailedCell:
    """What the session remembers of a cell that failed, for ``%distrain debug``."""

    cell: str  # its label (Cell In[12])
    raised: tuple[int, ...] = ()  # ranks whose own code raised, the shown one first
    pids: dict[int, int] = field(default_factory=dict)  # each failed rank's engine process

    @classmethod
    def of(cls, error: BaseException, cell: str) -> FailedCell:
        if isinstance(error, WorkerError):
            return cls(
                cell=cell,
                raised=tuple(error.ranks),
                pids={f.rank: f.pid for f in error.failures if f.pid},
            )
        return cls(cell=cell)


def debug_hint(rank: int) -> str:
    """The failed cell's pointer to the post-mortem."""
    return f"To look at rank {rank}'s variables where it raised: %distrain debug"


def _prompt(rank: int, mode: str) -> str:
    return f"(rank {rank}) {mode}"


def debug(
    session: Any,
    rank: int | None,
    commands: Sequence[str] | None,
    *,
    ask: Callable[[str], str] = input,
    out: Callable[[str], None] = print,
) -> None:
    """Open the post-mortem on ``rank`` (default: the rank whose error the cell showed) and
    feed it ``commands``, or the lines the user types, until pdb ends (``q``, ``c``)."""
    failed: FailedCell | None = session.failed
    if failed is None:
        raise UsageError(
            "%distrain debug: the last %%distrain cell did not fail, so there is nothing to "
            "look at (a post-mortem opens on the frames of a cell that raised, until the next "
            "cell runs; after a Stop, %distrain where shows where each rank was)."
        )
    cluster = session.cluster
    if not cluster.running or not cluster.engines:
        raise UsageError(
            f"%distrain debug: the workers that ran {failed.cell} are gone, and with them its "
            "frames (the workers were stopped since)."
        )
    size = cluster.size
    if rank is None:
        rank = failed.raised[0] if failed.raised else _first_holding(cluster)
    if not 0 <= rank < size:
        raise UsageError(
            f"%distrain debug: rank {rank} does not exist; ranks go from 0 to {size - 1}."
        )
    _check_same_engine(cluster, rank, failed)
    if rank in session.still_running:
        raise UsageError(
            f"%distrain debug: rank {rank} still runs {session.still_running[rank]}: it can "
            "look at nothing else until that ends (%distrain status shows it)."
        )
    reply = _call(cluster, rank, debugging.open_debugger, timeout=OPEN_TIMEOUT_S)
    if reply.ended:
        raise UsageError(f"%distrain debug: rank {rank}: {reply.text}.")
    show(reply.text, out)
    try:
        if commands is not None:
            for line in commands:
                out(_prompt(rank, reply.prompt) + line)
                reply = _call(cluster, rank, debugging.command, line)
                show(reply.text, out)
                if reply.ended:
                    return
            return
        while not reply.ended:
            try:
                line = ask(_prompt(rank, reply.prompt))
            except StdinNotImplementedError:
                raise UsageError(
                    "%distrain debug: this front end has no input box for the debugger's "
                    f"prompt; give the commands instead, e.g. %distrain debug {rank} "
                    "-c 'p loss' -c 'w'."
                ) from None
            except EOFError:
                return
            reply = _call(cluster, rank, debugging.command, line)
            show(reply.text, out)
    except KeyboardInterrupt:
        out(f"nbdist: debug: interrupted; rank {rank}'s debugger closed.")
    finally:
        if not reply.ended:
            _close(cluster, rank)


def _call(cluster: Any, rank: int, fn: Any, *args: Any, timeout: float | None = None) -> Any:
    """``fn(*args)`` on ``rank``; waits as long as it runs (a ``p`` of a slow expression),
    ``timeout`` where given; an interrupt reaches the caller."""
    ar = cluster.apply_async(rank, fn, *args)
    start = time.monotonic()
    while not ar.ready():
        if timeout is not None and time.monotonic() - start > timeout:
            raise UsageError(
                f"%distrain debug: rank {rank} did not answer within {timeout:g} s (is a cell "
                "still running there? %distrain status shows which rank is busy)."
            )
        ar.wait(POLL_S)
    try:
        return ar.get()
    except Exception as e:
        raise UsageError(f"%distrain debug: rank {rank}: {remote_message(e)}") from None


def _close(cluster: Any, rank: int) -> None:
    try:
        cluster.apply_async(rank, debugging.close).get(OPEN_TIMEOUT_S)
    except Exception:  # noqa: S110 - a rank that cannot close its debugger has nothing open
        pass


def _first_holding(cluster: Any) -> int:
    """The lowest rank whose engine holds a failed cell's frames (an interrupt, a stall or a
    timeout shows no one rank)."""
    ranks = [e.rank for e in cluster.engines]
    ars = [cluster.apply_async(r, debugging.held) for r in ranks]
    for r, ar in zip(ranks, ars, strict=True):  # the lowest first, without waiting for the others
        answer = reply(r, ar, OPEN_TIMEOUT_S)  # (a rank that cannot say holds nothing)
        if answer.ok and answer.value is not None:
            return r
    raise UsageError(
        "%distrain debug: no rank holds the frames of the cell that failed (a rank that was "
        "interrupted or stopped at a step keeps none; one that died took them with it)."
    )


def _check_same_engine(cluster: Any, rank: int, failed: FailedCell) -> None:
    """A rank whose engine died, or was replaced since the failure, has no frames to show."""
    then = failed.pids.get(rank)
    engine = cluster.engines[rank]
    dead = cluster.dead([rank])
    if then is not None and (dead or engine.pid != then):
        others = [
            r
            for r in failed.raised
            if r != rank and not cluster.dead([r]) and cluster.engines[r].pid == failed.pids.get(r)
        ]
        how = "died" if dead else f"was replaced (rank {rank} is now pid {engine.pid})"
        more = f"; rank {others[0]} holds its own: %distrain debug {others[0]}" if others else ""
        raise UsageError(
            f"%distrain debug: the engine that ran rank {rank} in {failed.cell} (pid {then}) "
            f"{how}, and its frames went with it{more}."
        )
    if then is None and dead:
        raise UsageError(
            f"%distrain debug: {cluster.gone_text([rank], when=' after the cell')}, and its "
            "frames with it."
        )


def where(session: Any, out: Callable[[str], None] = print) -> None:
    """``%distrain where``: how the last cell ended on every rank, and each one's stack then,
    the cell's own lines first (after a Stop, an interrupt, a stall or an error)."""
    cluster = session.cluster
    if not cluster.running or not cluster.engines:
        raise UsageError("%distrain where: no workers are running; run a %%distrain cell first.")
    ranks = [e.rank for e in cluster.engines]
    dead = set(cluster.dead(ranks))
    ars = {r: cluster.apply_async(r, debugging.where) for r in ranks if r not in dead}
    told = False
    for r in ranks:
        if r in dead:
            out(f"rank {r}: " + cluster.gone_text([r], when=" after its last cell"))
            told = True
            continue
        if r in session.still_running:
            out(f"rank {r}: still runs {session.still_running[r]}")
            told = True
            continue
        answer = reply(r, ars[r], OPEN_TIMEOUT_S)
        if answer.error is not None:
            out(f"rank {r}: did not say ({remote_message(answer.error)})")
            told = True
            continue
        text = answer.value
        if text is not None:
            out(f"rank {r}: {text}")
            told = True
    if not told:
        out("nbdist: where: the last cell ended normally on every rank (no stack to show).")
