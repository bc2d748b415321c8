"""Metric points recorded on a rank and streamed to the notebook while the cell runs.

ipyparallel's ``publish_data`` merges dicts on the client, keeping only the latest value per
key (``shared/NOTES.md``), so a reader polling one key would drop points. Each message here
goes under its own key, ``nbdist-<seq>``, with ``seq`` counting messages 0, 1, 2, ... per rank;
the notebook side pops keys in order (bounded memory there) and detects any gap. Points are
batched: a message goes out when ``FLUSH_S`` has passed since the last one (longer on many
ranks: ``flush_interval``) or ``MAX_BATCH`` points are waiting (bounded memory here), and once
more when the run ends.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nbdist.engine import stopping, ticker
from nbdist.engine.state import engine_state
from nbdist.protocol import KEY_PREFIX, META_KEY, MetricPoint, RunMeta

FLUSH_S = 0.1
MAX_BATCH = 1000
# All ranks together send at most about this many messages a second: the notebook reads each
# one (ipyparallel's data channel carried ~3,900 messages/s on a 2-core machine, and the kernel
# has the panel to draw as well). Beyond 100 ranks a rank batches longer than FLUSH_S.
MAX_MESSAGES_PER_S = 1000


def flush_interval(world: int) -> float:
    """Seconds between one rank's metric messages in a run on ``world`` ranks: ``FLUSH_S`` up
    to 100 ranks, then longer, so that all of them send ``MAX_MESSAGES_PER_S`` together."""
    return max(FLUSH_S, world / MAX_MESSAGES_PER_S)


def _scalar(value: Any) -> Any:
    """A plain float for tensors and numpy scalars; anything else as it is."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


class Recorder:
    """Records one rank's metric points for one run and publishes them in batches.

    ``log`` is what the cell calls; it turns automatic capture off for the quantities it logs.
    ``auto`` is what the backends' hooks call (the loss of each ``backward()``, a Keras batch).
    """

    def __init__(
        self,
        publish: Callable[[dict[str, Any]], None],
        *,
        autolog: bool = True,
        total_steps: int | None = None,
        flush_s: float = FLUSH_S,
    ) -> None:
        self._publish = publish
        self.flush_s = flush_s
        self.autolog = autolog
        self.total_steps = total_steps
        self.messages = 0
        # What the safety net for independent copies reads (see nbdist.kernel.session): the
        # training steps autolog saw (backward()s, Keras batches), and the collectives that ran
        # on this rank during the cell (None: the backend cannot count them).
        self.steps = 0
        self.collectives: int | None = None
        self._step = 0
        self._explicit: set[str] = set()
        self._pending: dict[str, Any] = {}
        self._meta = RunMeta()
        self._buffer: list[MetricPoint] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._tick: ticker.Tick | None = None

    def start(self) -> None:
        """Flush every ``flush_s`` from the engine's ticker thread too, so the last points
        before a rank blocks (in a collective, a sleep) reach the notebook instead of waiting for
        the next log."""
        self._tick = ticker.every(self.flush_s, self._flush_if_due)

    def close(self) -> None:
        """Stop the periodic flush and send what is left."""
        if self._tick is not None:
            self._tick.cancel()
        self.flush()

    def _flush_if_due(self) -> None:
        if time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def log(self, step: int | None = None, **metrics: Any) -> None:
        """Record ``metrics`` (e.g. ``loss=..., samples=...``) for this rank at ``step``."""
        taken = sorted(OWN_FIELDS.keys() & metrics.keys())
        if taken:
            name = taken[0]
            what, instead = OWN_FIELDS[name]
            raise ValueError(
                f"log({name}=...): every point has its own '{name}' ({what}), which this would "
                f"overwrite. Log it under another name: log({instead}=...)"
            )
        self._explicit.update(metrics)
        self._record(step, metrics)
        stopping.boundary("log")

    __call__ = log  # the cell's ``log(...)`` is the recorder itself

    def expect(self, total_steps: int) -> None:
        """Announce how many steps the run will take, for the panel's ETA."""
        self.meta(total_steps=int(total_steps))

    def meta(self, **info: Any) -> None:
        """Facts about the run (total steps, batch sizes); the notebook keeps the latest."""
        self._meta = replace(self._meta, **info)
        self._publish({META_KEY: self._meta})

    def model(self, model: Any) -> None:
        """The model this run trains (autolog's): the notebook continues an earlier cell's loss
        curve only for the same one. Said once per model, not per step.

        A model is known by a number this engine gives each model object it sees (``id()``
        would do only while the object lives: a new model often gets the old one's address).
        """
        state = engine_state()
        try:
            number = state.models.get(model)
            if number is None:
                state.models_seen += 1
                number = state.models[model] = state.models_seen
        except TypeError:  # cannot be weakly referenced: known by its address
            number = f"id{id(model):x}"
        key = f"{type(model).__module__.split('.')[0]}:{os.getpid()}:{number}"
        if self._meta.model != key:
            self.meta(model=key)

    def auto(self, **metrics: Any) -> None:
        """Record automatically captured metrics, except those the cell logs itself."""
        if not self.autolog:
            return
        kept = {k: v for k, v in metrics.items() if k not in self._explicit}
        if kept:
            self._record(None, kept)

    def pend(self, **metrics: Any) -> None:
        """Hold automatically captured metrics to join the next point (a batch's size)."""
        if self.autolog:
            self._pending.update({k: v for k, v in metrics.items() if k not in self._explicit})

    def _record(self, step: int | None, metrics: dict[str, Any]) -> None:
        if step is None:
            step = self._step
        self._step = step + 1
        if self._pending:
            metrics = {**self._pending, **metrics}
            self._pending = {}
        with self._lock:
            self._buffer.append(MetricPoint(step, time.time(), metrics))
            due = (
                len(self._buffer) >= MAX_BATCH
                or time.monotonic() - self._last_flush >= self.flush_s
            )
        if due:
            self.flush()

    def flush(self) -> None:
        """Publish the waiting points as one message."""
        with self._lock:
            self._last_flush = time.monotonic()
            if not self._buffer:
                return
            batch, self._buffer = self._buffer, []
            # Tensors become floats here, ~10 times a second, not at every step (a GPU sync each).
            points = [MetricPoint(s, t, {k: _scalar(v) for k, v in m.items()}) for s, t, m in batch]
            self._publish({f"{KEY_PREFIX}{self.messages:08d}": points})
            self.messages += 1


# What each point carries besides its metrics (the notebook's stream adds "rank").
OWN_FIELDS = {
    "rank": ("the rank that logged it", "worker_rank"),
    "time": ("when it was logged, which samples/s is computed from", "time_s"),
}


def log(step: int | None = None, **metrics: Any) -> None:
    """Record metrics for this rank from inside a ``%%distrain`` cell (``nbdist.log``).

    ``log(loss=loss, samples=len(batch))`` records one point; ``step`` defaults to one more than
    the last. Logging a quantity yourself turns its automatic capture off for the run.
    """
    recorder = engine_state().recorder
    if recorder is None:
        raise RuntimeError(
            "nbdist.log records metrics from inside a %%distrain cell; in the notebook itself "
            "there is no run to record them for."
        )
    recorder.log(step, **metrics)
