"""State an engine process keeps between runs.

An ipyparallel engine lives across many ``%%distrain`` cells, and what a backend sets up once
(a process group, a pinned GPU) must be found again by the next run in the same process. That is
per-process state by nature, so it lives in one object owned by this module, reached only
through :func:`engine_state`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineState:
    """What this engine has set up: frameworks warmed up, its GPU, and per-backend slots."""

    warm: set[str] = field(default_factory=set)
    gpu: str | None = None
    address: str | None = None  # where other hosts reach this engine (None: not asked yet)
    slots: dict[str, dict[str, Any]] = field(default_factory=dict)
    recorder: Any = None  # the running cell's metrics Recorder, None between runs
    # The workers' variables when the engine has no IPython shell (see nbdist.engine.namespace).
    namespace: dict[str, Any] = field(default_factory=lambda: {"__name__": "__main__"})
    figure_formats: bool = False  # matplotlib figures display as PNG from this engine

    def slot(self, backend: str) -> dict[str, Any]:
        """The mutable dict a backend keeps its own state in."""
        return self.slots.setdefault(backend, {})


_STATE = EngineState()


def engine_state() -> EngineState:
    """This engine process's state."""
    return _STATE
