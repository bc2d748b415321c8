"""State an engine process keeps between runs.

An ipyparallel engine lives across many ``%%distrain`` cells, and what a backend sets up once
(a process group, a pinned GPU) must be found again by the next run in the same process. That is
per-process state by nature, so it lives in one object owned by this module, reached only
through :func:`engine_state`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineState:
    """What this engine has set up: frameworks warmed up, its GPU, and per-backend slots."""

    warm: set[str] = field(default_factory=set)
    cuda_index: int | None = None  # this engine's device is cuda:<cuda_index> (None: the CPU)
    address: str | None = None  # where other hosts reach this engine (None: not asked yet)
    slots: dict[str, dict[str, Any]] = field(default_factory=dict)
    recorder: Any = None  # the running cell's metrics Recorder, None between runs
    # The workers' variables when the engine has no IPython shell (see nbdist.engine.namespace).
    namespace: dict[str, Any] = field(default_factory=lambda: {"__name__": "__main__"})
    displays_set_up: bool = False  # figures as PNG, progress as text (nbdist.engine.display)
    # Each model object autolog has seen, numbered (Recorder.model): id() is reused.
    models: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    models_seen: int = 0
    # Each cell's code file name -> its label as the notebook shows it (Cell In[12]).
    cell_labels: dict[str, str] = field(default_factory=dict)

    def slot(self, backend: str) -> dict[str, Any]:
        """The mutable dict a backend keeps its own state in."""
        return self.slots.setdefault(backend, {})


_STATE = EngineState()


def engine_state() -> EngineState:
    """This engine process's state."""
    return _STATE
