"""The notebook's side of the metrics stream: every point of every rank, in order.

Each rank publishes batches of points under keys ``nbdist-<seq>`` (``nbdist.engine.metrics``).
:class:`MetricsStream` pops those keys from each rank's ``AsyncResult.data`` in sequence order,
so the client's dict never holds more than the messages not yet read, and records a gap if a
sequence number is ever skipped.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from nbdist.engine.metrics import flush_interval
from nbdist.protocol import KEY_PREFIX, META_KEY, RunMeta
from nbdist.ranks import MANY_RANKS


@dataclass
class MetricsStream:
    """Merges the points of ``world`` ranks as they arrive."""

    world: int
    history: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)  # (rank, missing seq)
    received: list[int] = field(init=False)
    meta: list[RunMeta] = field(init=False)
    last_step: list[int | None] = field(init=False)

    def __post_init__(self) -> None:
        self.received = [0] * self.world
        self.meta = [RunMeta() for _ in range(self.world)]
        self.last_step = [None] * self.world

    def pump(self, rank: int, data: MutableMapping[str, Any]) -> int:
        """Take rank ``rank``'s new messages out of ``data``; returns the points added."""
        if META_KEY in data:
            self.meta[rank] = data[META_KEY]
        keys = sorted(k for k in list(data) if k.startswith(KEY_PREFIX))
        added = 0
        for key in keys:
            seq = int(key[len(KEY_PREFIX) :])
            while self.received[rank] < seq:  # a message that never came
                self.gaps.append((rank, self.received[rank]))
                self.received[rank] += 1
            for step, t, metrics in data.pop(key):
                self.history.append({"rank": rank, "step": step, "time": t, **metrics})
                self.last_step[rank] = step
                added += 1
            self.received[rank] = seq + 1
        return added

    def complete(self, expected: list[int]) -> bool:
        """Whether every rank's ``expected`` number of messages has been read."""
        return all(got >= want for got, want in zip(self.received, expected, strict=True))

    def total_steps(self) -> int | None:
        """The largest total any rank announced, if any did."""
        totals = [m.total_steps for m in self.meta if m.total_steps]
        return max(totals) if totals else None


class Rounds:
    """Which ranks' tasks the kernel reads at each pump (every ``pump_s``).

    Reading a task's data or output parses its metadata (5-10 µs a read in bench-scale, three
    reads a rank): every rank at every pump would be 30,720 reads/s at 512 ranks, a sixth to a
    third of a core, for messages that come every half second. A rank sends a message
    every ``flush_interval(world)`` only, so beyond ``MANY_RANKS`` ranks each is read about
    that often, the ranks spread over the pumps in between; up to it, every rank every pump.
    """

    def __init__(self, world: int, pump_s: float) -> None:
        self.world = world
        self.every = 1 if world <= MANY_RANKS else max(1, round(flush_interval(world) / pump_s))
        self._turn = 0

    def next(self) -> range:
        """The positions to read at this pump."""
        due = range(self._turn, self.world, self.every)
        self._turn = (self._turn + 1) % self.every
        return due
