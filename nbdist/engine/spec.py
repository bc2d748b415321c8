"""What the notebook sends to each engine for one run: plain, picklable data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
