"""Where a cell's time goes in the notebook's kernel, phase by phase (the cost of a short cell:
``benchmarks/session_cell.py --phases`` prints it). One clock read per phase boundary.

The phases, in order: ``options`` (the magic's flags), ``plan`` (framework, cluster, group),
``checker`` (the mistakes checker), ``memory`` (the engines' OOM counts noted), ``submit`` (one
task per rank), ``watch`` (the loop until every rank is done: mostly waiting for the engines),
``settle`` (the last output, the reports, the group kept or rebuilt) and ``result`` (the value,
the summary, the figure). ``engine`` is the slowest rank's own time in its task, as it measured
it (within ``watch``).
"""

from __future__ import annotations

import time


class Phases:
    """The last cell's time per phase, in seconds."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._at = time.perf_counter()

    def start(self) -> None:
        """A cell begins: the first phase counts from here."""
        self.times = {}
        self._at = time.perf_counter()

    def mark(self, name: str) -> None:
        """Phase ``name`` ends now (a phase marked twice adds up)."""
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self._at
        self._at = now

    def note(self, name: str, seconds: float) -> None:
        """A time measured elsewhere (the engines' own)."""
        self.times[name] = seconds
