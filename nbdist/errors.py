"""Errors raised by nbdist, all in one tree::

    DistrainError                 base of everything nbdist raises in the notebook
    ├── WorkerError               one or more ranks raised inside the cell
    ├── WorkerDied                an engine process died during the job (engines are replaced)
    ├── JobTimeout                ``--timeout`` elapsed; every rank was stopped
    │   └── JobStalled            a rank made no progress for ``--stall`` seconds (default 60)
    │       └── RanksDisagree     some ranks finished (or wait in another collective) while
    │                             others wait in a collective: different steps or code paths
    ├── JobInterrupted            the notebook's interrupt stopped the job
    └── ClusterError              the ipyparallel cluster could not be started or reached

    NbdistWarning                 warnings nbdist itself emits

Misuse of the magic (bad flags, a cell that does not parse, a variable that cannot be pushed) is
IPython's ``UsageError``: it is reported before anything runs on the engines.

Each error renders in the notebook as its message alone (``_render_traceback_``): the kernel-side
frames of nbdist say nothing useful to the person who wrote the cell; the remote traceback does.
"""

from __future__ import annotations

import re
from dataclasses import replace

from nbdist.protocol import RankFailure
from nbdist.ranks import MANY_RANKS, spans

__all__ = [
    "ClusterError",
    "DistrainError",
    "JobInterrupted",
    "JobStalled",
    "JobTimeout",
    "NbdistWarning",
    "RankFailure",
    "RanksDisagree",
    "WorkerDied",
    "WorkerError",
]


class NbdistWarning(UserWarning):
    """A warning emitted by nbdist."""


class DistrainError(Exception):
    """Base class of the errors nbdist raises in the notebook.

    ``state`` is the closing line the session adds: what became of the workers' variables.
    """

    state: str = ""

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}\n{self.state}" if self.state else base

    def _render_traceback_(self) -> list[str]:
        return f"{type(self).__name__}: {self}".splitlines()


class ClusterError(DistrainError):
    """The ipyparallel cluster could not be started, reached or resized."""


class ExportError(DistrainError):
    """``%distrain export`` cannot write the session as one script (the message says why and
    what to do)."""


class JobTimeout(DistrainError):
    """The job ran past ``--timeout``; every rank was stopped."""


class JobStalled(JobTimeout):
    """A rank made no progress (no logged step, no backward, no Keras batch) for ``--stall``
    seconds while the job ran; every rank was stopped.

    ``flight`` is what torch's flight recorder saw on the waiting ranks (each one's last
    collective, numbered), shown with the error; empty where no recorder said."""

    flight: str = ""

    def _render_traceback_(self) -> list[str]:
        lines = f"{type(self).__name__}: {Exception.__str__(self)}".splitlines()
        if self.flight:
            lines.append(self.flight)
        return [*lines, *self.state.splitlines()]


class RanksDisagree(JobStalled):
    """Some ranks finished the cell, or wait in a different collective, while others wait in
    a collective that can never complete: the ranks ran different numbers of steps or took
    different code paths. nbdist frees the waiting ranks without killing them (torch)."""


class JobInterrupted(DistrainError):
    """The notebook's interrupt (or the Stop button) stopped the job."""

    outside = False  # a stop signal sent from outside the notebook stopped it


class WorkerDied(DistrainError):
    """An engine process died during the job; nbdist replaced the engines."""


# A rank whose collective lost its peer fails with one of these; it is a consequence, not a cause.
_PEER_LOST = re.compile(
    r"Connection (reset|closed) by peer|pair closure|Socket Timeout|Timed out waiting|"
    r"gloo/transport|NCCL communicator was aborted|CollectiveOps|Collective ops is aborted|"
    r"DeadlineExceeded|UnavailableError",
    re.IGNORECASE,
)


def lost_peer(failure: RankFailure) -> bool:
    """Whether the rank failed because a peer was gone (its collective lost the connection)."""
    return bool(_PEER_LOST.search(f"{failure.exc_type}: {failure.message}"))


def classify(failures: list[RankFailure]) -> list[RankFailure]:
    """Mark the failures that only followed another rank's failure as collateral.

    The earliest failure is always a cause. A later one is collateral when it is an interrupt
    (nbdist stops the remaining ranks with SIGINT) or a lost-peer error from the collectives.
    """
    if not failures:
        return []
    ordered = sorted(failures, key=lambda f: (f.time, f.rank))
    first = ordered[0]
    out = []
    for f in failures:
        collateral = f is not first and (f.interrupted or lost_peer(f))
        out.append(replace(f, collateral=collateral))
    return out


SHOWN_GROUPS = 3  # beyond MANY_RANKS ranks, at most this many different failures in full


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > MANY_RANKS:
        return f"{len(ranks)} ranks " + spans(sorted(ranks))
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


class WorkerError(DistrainError):
    """One or more ranks raised inside the cell.

    Attributes
    ----------
    failures : list of RankFailure
        One entry per failed rank, in rank order.
    stopped : list of int
        Ranks that were still running and were stopped because of the failure.
    """

    def __init__(self, failures: list[RankFailure], stopped: list[int] | None = None):
        self.failures = sorted(classify(failures), key=lambda f: f.rank)
        self.stopped = sorted(stopped or [])
        self.notes: list[str] = []  # what the session adds about the failure's likely cause
        super().__init__(self._message())

    @property
    def ranks(self) -> list[int]:
        """Ranks whose own code raised (not those that only lost a peer)."""
        return [f.rank for f in self.failures if not f.collateral]

    def _groups(self) -> list[tuple[list[RankFailure], RankFailure]]:
        """Causes grouped by identical traceback, so N identical failures print once."""
        groups: dict[tuple[str, str], list[RankFailure]] = {}
        for f in self.failures:
            if not f.collateral:
                groups.setdefault((f.headline, f.traceback), []).append(f)
        return [(fs, fs[0]) for fs in groups.values()]

    def _message(self) -> str:
        parts = []
        groups = self._groups()
        for members, f in groups[:SHOWN_GROUPS]:
            hosts = sorted({m.host for m in members})
            if len(hosts) > SHOWN_GROUPS:
                hosts = [*hosts[:SHOWN_GROUPS], f"... {len(hosts)} hosts"]
            where = f"{_ranks_text([m.rank for m in members])} (host {', '.join(hosts)})"
            parts.append(f"{where} raised {f.headline}")
            if f.line is not None:
                parts.append(f"  at {f.where}: {f.line_text.strip()}")
        rest = groups[SHOWN_GROUPS:]
        if rest:  # hundreds of ranks failing each their own way: counted, not all printed
            ranks = [m.rank for members, _ in rest for m in members]
            types: dict[str, int] = {}
            for members, f in rest:
                types[f.exc_type] = types.get(f.exc_type, 0) + len(members)
            kinds = ", ".join(f"{t} ×{n}" for t, n in types.items())
            parts.append(
                f"... and {len(rest)} more different failures on {_ranks_text(ranks)} ({kinds}); "
                "each is in the error's .failures (sys.last_value.failures after the cell)"
            )
        return "\n".join(parts) if parts else "the job failed"

    def _render_traceback_(self) -> list[str]:
        lines = [*f"WorkerError: {self._message()}".splitlines(), ""]
        for members, f in self._groups()[:SHOWN_GROUPS]:
            lines.append(f"--- remote traceback, {_ranks_text([m.rank for m in members])} ---")
            lines.extend(f.traceback.rstrip("\n").splitlines())
            lines.append("")
        collateral = [f.rank for f in self.failures if f.collateral]
        others = sorted(set(collateral) | set(self.stopped))
        if others:
            lines.append(f"{_ranks_text(others)} stopped because a peer failed.")
        if any(f.exc_type == "SystemExit" for f in self.failures if not f.collateral):
            lines.append(EXIT_NOTE)
        lines.extend(self.notes)
        lines.append(self.state or "Fix the cell and run it again.")
        return lines


EXIT_NOTE = (
    "exit(), quit() and sys.exit() end a %%distrain cell on the ranks that call them, not the "
    "workers: those keep running, with their variables. To stop the workers: %distrain stop."
)
