"""What the notebook sends to each engine for one run, and what each sends back: plain,
picklable data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbdist.errors import RankFailure


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """One rank's share of a ``%%distrain`` run.

    ``env`` is the per-rank environment from the backend's ``rendezvous``; it is applied for the
    duration of the run only. ``options`` are backend options (e.g. ``{"backend": "gloo"}``).
    """

    run_id: int
    framework: str
    source: str
    filename: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    env: dict[str, str]
    options: dict[str, Any] = field(default_factory=dict)
    push: dict[str, Any] = field(default_factory=dict)
    pull: tuple[str, ...] = ()
    autolog: bool = True
    fresh: bool = False  # run in a throwaway namespace instead of the session's


@dataclass(kw_only=True)
class RankReport:
    """What one rank sends back from a run (``worker.run_rank`` never raises: a failure of the
    cell is ``failure``). The notebook reads these fields, nothing else."""

    rank: int
    host: str
    pid: int
    failure: RankFailure | None = None
    value: Any = None  # the last expression's value, when it can be pickled
    value_repr: str | None = None  # its repr; None when the cell has no value
    names: list[str] = field(default_factory=list)  # the session's variables after the run
    messages: int = 0  # metrics messages published (the notebook waits for that many)
    wall: float = 0.0
    pulled: dict[str, Any] = field(default_factory=dict)  # --pull's values (first rank only)
    pull_error: str | None = None  # a --pull name that failed (the cell itself ran)
