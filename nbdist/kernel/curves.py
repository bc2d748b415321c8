"""What a run's metric points say, as numbers: the loss per step, each rank's samples/s, and
which rank keeps the others waiting. Pure data, no drawing (``figure.py`` draws it).

Throughput comes from the workers' own step timestamps, never from when points reach the
notebook: points travel in batches (a flush every 0.1 s, or a Keras epoch's worth at once), so
a rate computed from arrivals dips to zero between batches and drops at the end of a run. Here
each rank's rate at a point is the samples of the steps that ended within the last
``RATE_WINDOW_S`` seconds over the time they took, which a steady worker keeps flat however its
points arrive.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbdist.ranks import MANY_RANKS

RATE_WINDOW_S = 2.0
GRID_POINTS = 200  # the total's curve: the ranks' rates summed at this many instants
# A straggler is named only when its effect is real and sizeable: it works STRAGGLER_RATIO times
# (and STRAGGLER_MIN_S) longer per step than the others, over MIN_STRAGGLER_STEPS steps, the
# others wait for it at least STRAGGLER_WAIT_SHARE of their step, and its extra work adds up to
# STRAGGLER_MIN_TOTAL_S over the steps measured: a 0.1 s cell (tutorial 01's), or a rank that
# a busy machine slowed for a moment, names none.
STRAGGLER_RATIO = 1.25
STRAGGLER_MIN_S = 0.001
MIN_STRAGGLER_STEPS = 20
STRAGGLER_WAIT_SHARE = 0.1
STRAGGLER_MIN_TOTAL_S = 0.5
MIN_WORK_STEPS = 10  # steps measured before a rank's working time is shown
WORK_WINDOW = 200  # steps: the working time per step is a median over the most recent ones
LOG_DECADES = 2.0  # the loss axis turns logarithmic when the loss spans more than this
TOO_SHORT = "too short to measure throughput"
# Beyond MANY_RANKS ranks the panel summarises them (a line or table row each is unreadable, and
# at 512 ranks its legend alone took seconds to draw): mean and min–max band, rows per host.
BAND_S = 0.5  # ...and the ranks' samples/s are summarised at instants this far apart


class RankRate:
    """One rank's samples/s over a sliding window of its own timestamps.

    ``add`` takes each point's time and the samples of the step that ended then; the rate at a
    point ``i`` is ``(S[i] - S[k]) / (t[i] - t[k])`` with ``S`` the running total of samples and
    ``k`` the earliest point at most ``RATE_WINDOW_S`` earlier: the samples of steps ``k+1 ..
    i``, which all ran between ``t[k]`` and ``t[i]``. Amortised O(1) per point.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.totals: list[float] = []
        self.rate_times: list[float] = []
        self.rates: list[float] = []
        self._k = 0

    def add(self, t: float, samples: float) -> None:
        if self.times and t < self.times[-1]:
            t = self.times[-1]  # a clock stepped back: keep the series ordered
        total = (self.totals[-1] if self.totals else 0.0) + samples
        self.times.append(t)
        self.totals.append(total)
        i = len(self.times) - 1
        while self._k < i - 1 and self.times[self._k] < t - RATE_WINDOW_S:
            self._k += 1
        span = t - self.times[self._k]
        if i > 0 and span > 0:
            self.rate_times.append(t)
            self.rates.append((total - self.totals[self._k]) / span)

    def mean(self) -> float | None:
        """Samples/s from this rank's first point to its last; None before two points."""
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return None
        return (self.totals[-1] - self.totals[0]) / (self.times[-1] - self.times[0])

    @property
    def samples(self) -> float:
        return self.totals[-1] if self.totals else 0.0


@dataclass
class Segment:
    """An earlier cell's loss curve in this session, in the session's step numbers."""

    steps: list[int]
    loss: list[float]


@dataclass
class Aggregate:
    """Running per-step and per-rank summaries of the metric points of one run.

    ``earlier`` are the session's earlier cells: when this cell's steps start below the step
    after theirs (a new loop counting from 0), they are shifted to continue the session's
    curve; steps that already continue it (a global step kept on the workers) stay as they are.
    """

    world: int
    start: float = field(default_factory=time.time)
    earlier: Sequence[Segment] = ()
    loss: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> loss
    rates: list[RankRate] = field(init=False)
    work: list[list[float]] = field(init=False)  # per rank: seconds of own work per step
    wait: list[list[float]] = field(init=False)  # per rank: seconds waiting for the others
    last: list[dict[str, Any]] = field(init=False)
    offset: int | None = None  # this cell's steps + offset = the session's steps
    total_steps: int | None = None
    seen: int = 0
    # step -> [sum, count, min, max] of the ranks' losses, kept as points arrive: a redraw on
    # 512 ranks would otherwise go over every rank's loss at every step.
    _loss_stats: dict[int, list[float]] = field(init=False)
    _steps: list[int] = field(init=False)  # sorted
    _work_cache: tuple[int, dict[int, float | None]] = field(init=False)
    bands: RankBands | None = field(init=False)

    def __post_init__(self) -> None:
        self.step_base = self.earlier[-1].steps[-1] + 1 if self.earlier else 0
        self.rates = [RankRate() for _ in range(self.world)]
        self.work = [[] for _ in range(self.world)]
        self.wait = [[] for _ in range(self.world)]
        self.last = [{} for _ in range(self.world)]
        self._loss_stats = {}
        self._steps = []
        self._work_cache = (-1, {})
        self.bands = RankBands(self.world, self.start) if self.world > MANY_RANKS else None

    def _add_loss(self, step: int, rank: int, value: float) -> None:
        at = self.loss.get(step)
        if at is None:
            at = self.loss[step] = {}
            if self._steps and step < self._steps[-1]:
                bisect.insort(self._steps, step)
            else:
                self._steps.append(step)
        if rank in at:  # a rank logged this step again: its new value replaces the old one
            at[rank] = value
            v = list(at.values())
            self._loss_stats[step] = [sum(v), len(v), min(v), max(v)]
            return
        at[rank] = value
        st = self._loss_stats.get(step)
        if st is None:
            self._loss_stats[step] = [value, 1, value, value]
        else:
            st[0] += value
            st[1] += 1
            if value < st[2]:
                st[2] = value
            if value > st[3]:
                st[3] = value

    def add(self, history: Sequence[dict[str, Any]]) -> None:
        """Take in the points of ``history`` not seen yet."""
        for point in history[self.seen :]:
            rank = point["rank"]
            if "loss" in point:
                if self.offset is None:
                    self.offset = max(0, self.step_base - point["step"])
                self._add_loss(point["step"] + self.offset, rank, float(point["loss"]))
            if "samples" in point:
                rr = self.rates[rank]
                n = len(rr.rates)
                rr.add(point["time"], float(point["samples"]))
                if self.bands is not None and len(rr.rates) > n:
                    self.bands.add(rank, rr.rate_times[-1], rr.rates[-1])
            if "work" in point:
                self.work[rank].append(float(point["work"]))
                self.wait[rank].append(float(point.get("wait", 0.0)))
            self.last[rank] = {**self.last[rank], **point}
        self.seen = len(history)

    @property
    def continued(self) -> bool:
        """Whether this cell's steps continue earlier cells' (two counts: the cell's and the
        session's)."""
        return bool(self.offset)

    def step_text(self, cell_step: int) -> str:
        """A step of this cell as the panel, the summary and the Stop message say it:
        ``"step 57"``, or ``"step 57 of this cell, 68 in the session"`` when the cell continues
        earlier ones."""
        if not self.offset:
            return f"step {cell_step}"
        return f"step {cell_step} of this cell, {cell_step + self.offset} in the session"

    def loss_curve(self) -> tuple[list[int], list[float], list[float], list[float]]:
        """Steps (the session's), and the mean, min and max of the ranks' losses at each."""
        steps = list(self._steps)
        stats = [self._loss_stats[s] for s in steps]
        return (
            steps,
            [st[0] / st[1] for st in stats],
            [st[2] for st in stats],
            [st[3] for st in stats],
        )

    def rate(self, rank: int) -> float | None:
        """``rank``'s latest samples/s (over the last ``RATE_WINDOW_S`` of its own steps)."""
        rates = self.rates[rank].rates
        return rates[-1] if rates else None

    def throughput_curve(
        self,
    ) -> tuple[list[float], list[float], list[tuple[list[float], list[float]]]]:
        """The total's times (seconds since the start) and samples/s, summed over the ranks on
        the stretch where every rank that counts samples has a rate; each rank's own (times,
        samples/s). All empty when no rank has two points yet."""
        per_rank = [([t - self.start for t in r.rate_times], list(r.rates)) for r in self.rates]
        active = [r for r in self.rates if r.rates]
        if not active:
            return [], [], per_rank
        lo = max(r.rate_times[0] for r in active)
        hi = min(r.rate_times[-1] for r in active)
        if hi > lo:
            grid = [lo + (hi - lo) * i / (GRID_POINTS - 1) for i in range(GRID_POINTS)]
        else:
            grid = [max(r.rate_times[-1] for r in active)]
        total = [sum(_interp(t, r.rate_times, r.rates) for r in active) for t in grid]
        return [t - self.start for t in grid], total, per_rank

    def loss_decades(self) -> float | None:
        """How many decades the mean loss spans, this session's earlier cells included (they
        share the axis); None when it is not all positive."""
        _, mean, _, _ = self.loss_curve()
        values = [*mean, *(v for seg in self.earlier for v in seg.loss)]
        if not mean or min(values) <= 0:
            return None
        return math.log10(max(values) / min(values))

    def work_per_step(self, rank: int) -> float | None:
        """Median seconds ``rank`` works (not waiting for the others) per step, recently."""
        seen, cache = self._work_cache
        if seen != self.seen:  # one median per rank per batch of points, however often asked
            cache = {}
            self._work_cache = (self.seen, cache)
        if rank not in cache:
            work = self.work[rank][-WORK_WINDOW:]
            cache[rank] = statistics.median(work) if len(work) >= MIN_WORK_STEPS else None
        return cache[rank]

    def stragglers(self) -> list[tuple[int, float]]:
        """``(rank, ratio)`` for each rank the others wait for, when that matters (the rule is
        with ``STRAGGLER_RATIO``): ``ratio`` is its working time per step over the median of
        the other ranks'."""
        work = {r: w for r in range(self.world) if (w := self.work_per_step(r)) is not None}
        if len(work) < 2:
            return []
        ordered = sorted(work.values())  # the others' median from one sort, not one per rank
        out = []
        for rank, mine in work.items():
            others = _median_without(ordered, mine)
            steps = min(len(self.work[rank]), WORK_WINDOW)
            if not (
                others > 0
                and steps >= MIN_STRAGGLER_STEPS
                and mine > STRAGGLER_RATIO * others
                and mine - others > STRAGGLER_MIN_S
                and (mine - others) * steps >= STRAGGLER_MIN_TOTAL_S
                and self._others_wait(rank) >= STRAGGLER_WAIT_SHARE
            ):
                continue
            out.append((rank, mine / others))
        return out

    def _others_wait(self, rank: int) -> float:
        """The median share of their step the ranks other than ``rank`` spend waiting."""
        shares = []
        for r in range(self.world):
            work, wait = self.work[r][-WORK_WINDOW:], self.wait[r][-WORK_WINDOW:]
            if r == rank or len(work) < MIN_WORK_STEPS:
                continue
            step = statistics.median(w + t for w, t in zip(work, wait, strict=True))
            shares.append(statistics.median(wait) / step if step > 0 else 0.0)
        return statistics.median(shares) if shares else 0.0

    def summary(self, wall: float, framework: str, detail: str = "", *, logy: bool = False) -> str:
        """One line: final loss, throughput, stragglers, wall time, workers."""
        parts = []
        steps, mean, _, _ = self.loss_curve()
        if steps:
            where = self.step_text(steps[-1] - (self.offset or 0))
            said = f"mean over ranks; {where}" if self.continued else f"{where}, mean over ranks"
            parts.append(f"final loss {number(mean[-1])} ({said})")
        if logy and (decades := self.loss_decades()) is not None:
            parts.append(f"loss axis logarithmic (the loss spans {decades:.1f} decades)")
        samples = sum(r.samples for r in self.rates)
        if samples:
            means = [r.mean() for r in self.rates if r.samples]
            if None not in means:  # from the workers' own timestamps
                total = sum(m for m in means if m is not None)
            else:  # a rank logged one point only: over the cell's wall time
                total = samples / wall if wall > 0 else 0.0
            parts.append(
                f"{total:,.0f} samples/s total, {total / self.world:,.0f} per rank "
                f"({samples:,.0f} samples)"
            )
        slow = self.stragglers()
        if slow:
            ranks = ", ".join(str(r) for r, _ in slow)
            ratios = ", ".join(f"{x:.1f}×" for _, x in slow)
            verb = "keeps" if len(slow) == 1 else "keep"
            parts.append(
                f"rank{'s' if len(slow) > 1 else ''} {ranks} {verb} the others waiting: "
                f"{ratios} their working time per step"
            )
        parts.append(f"wall {wall:.1f} s")
        parts.append(f"{self.world} worker{'s' if self.world > 1 else ''} ({framework}{detail})")
        return "nbdist: " + " · ".join(parts)

    def segment(self) -> Segment | None:
        """This cell's loss curve, for the next cell of the session to continue."""
        steps, mean, _, _ = self.loss_curve()
        return Segment(steps, mean) if steps else None


def number(value: float) -> str:
    """A loss as the summary says it: four significant digits, never ``-0``."""
    return f"{value + 0.0:.4g}" if value != 0 else "0"


def losses_text(values: Sequence[float | None]) -> list[str]:
    """The ranks' losses for the table, with as many decimals each as the largest needs for
    four significant digits: a column reads alike (``0.01014`` beside ``0.00813``, not
    ``0.008133``)."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v) and v != 0]
    if not finite:
        return ["" if v is None else number(v) for v in values]
    decimals = max(0, 3 - math.floor(math.log10(max(finite))))
    if decimals > 6:  # too small for a fixed column: four significant digits each, alike
        return ["" if v is None else f"{v + 0.0:.3e}" for v in values]
    return ["" if v is None else f"{v + 0.0:.{decimals}f}" for v in values]


def _median_without(ordered: list[float], value: float) -> float:
    """The median of ``ordered`` (sorted) with one occurrence of ``value`` left out."""
    i = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    if m % 2:
        return at(m // 2)
    return (at(m // 2 - 1) + at(m // 2)) / 2


class RankBands:
    """The ranks' samples/s every ``BAND_S`` seconds of the run: mean, min, max and total over
    the ranks, each rank counted at its latest rate (for runs of more than ``MANY_RANKS``
    ranks, drawn as a band instead of a line per rank).

    An instant is summarised once every rank that counts samples has a rate after it (points
    arrive in batches, in any order across ranks), and never again: a redraw costs the
    instants still open times the ranks, not the whole run times the ranks.
    """

    def __init__(self, world: int, start: float) -> None:
        self.world, self.start = world, start
        self.newest = [-1] * world  # each rank's newest bin
        self._open: dict[int, dict[int, float]] = {}  # bin -> rank -> its last rate in the bin
        self._carry: list[float | None] = [None] * world  # each rank's rate at the closed bins' end
        self._closed: list[tuple[float, float, float, float, float]] = []
        self._next = 0  # the first bin not closed

    def add(self, rank: int, t: float, rate: float) -> None:
        b = max(0, int((t - self.start) // BAND_S))
        self._open.setdefault(b, {})[rank] = rate
        if b > self.newest[rank]:
            self.newest[rank] = b

    @staticmethod
    def _stats(b: int, carry: list[float | None]) -> tuple[float, float, float, float, float]:
        values = [c for c in carry if c is not None]
        total = sum(values)
        return ((b + 1) * BAND_S, total / len(values), min(values), max(values), total)

    def _fold(self, b: int, carry: list[float | None]) -> None:
        for rank, rate in self._open.get(b, {}).items():
            carry[rank] = rate

    def curve(self) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
        """Seconds since the start, and the ranks' mean, min, max and total samples/s there."""
        counting = [b for b in self.newest if b >= 0]
        if not counting:
            return [], [], [], [], []
        closed_to, last = min(counting), max(counting)
        while self._next < closed_to:
            self._fold(self._next, self._carry)
            self._open.pop(self._next, None)
            if any(c is not None for c in self._carry):
                self._closed.append(self._stats(self._next, self._carry))
            self._next += 1
        rows = list(self._closed)
        carry = list(self._carry)
        for b in range(self._next, last + 1):
            self._fold(b, carry)
            if any(c is not None for c in carry):
                rows.append(self._stats(b, carry))
        if not rows:
            return [], [], [], [], []
        t, mean, lo, hi, total = (list(col) for col in zip(*rows, strict=True))
        return t, mean, lo, hi, total


def _interp(t: float, xs: list[float], ys: list[float]) -> float:
    """``ys`` linearly interpolated at ``t`` (held constant beyond the ends)."""
    i = bisect.bisect_left(xs, t)
    if i <= 0:
        return ys[0]
    if i >= len(xs):
        return ys[-1]
    x0, x1 = xs[i - 1], xs[i]
    if x1 <= x0:
        return ys[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (t - x0) / (x1 - x0)
