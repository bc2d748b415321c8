"""``%%distrain --profile``: where each rank's step time goes, from the ranks' profiled windows.

Each rank sends its window (``nbdist.engine.profiling``): its steps, the intervals it computed
in, and each collective as it ran. A collective's duration on a rank includes the time that
rank waited for the last peer to arrive; the last to arrive waits for nobody. So the *i*-th
collective's transfer time is the shortest of its durations over the ranks (the ranks run the
same collectives in the same order), and on each rank the rest of its duration, at its start,
is waiting (the rule Holistic Trace Analysis and NCCL's own traces use). Per rank and step:

* computation: time in operators (CPU) or kernels (GPU);
* communication: collective transfer time not hidden behind computation;
* overlapped: collective transfer time during computation (part of computation's time);
* waiting: time blocked in a collective for a slower peer, not hidden behind computation;
* other: the rest of the step (Python, the data loader, the optimizer's bookkeeping).

Computation + communication + waiting + other is the step time, exactly: each instant of the
step is counted once, in the first of those classes it belongs to.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nbdist.engine.profiling import merge

Intervals = list[tuple[float, float]]

FOLDER = "nbdist-profile"  # under the notebook's working directory
MAX_LANES = 16  # ranks drawn in the timeline; the rest are in the table
PARTS = ("compute", "communication", "waiting", "other")


def length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The intersection of two merged interval lists."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """``a`` without ``b`` (both merged)."""
    out: Intervals = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


@dataclass(frozen=True)
class RankProfile:
    """One rank's profiled window. Times are milliseconds per step (means over the window)."""

    rank: int
    steps: int
    step_ms: float
    compute_ms: float
    communication_ms: float
    overlapped_ms: float
    waiting_ms: float
    other_ms: float
    top_ops: tuple[tuple[str, float, float], ...] = ()  # name, self ms per step, calls per step
    trace: str | None = None  # the Chrome trace file

    def share(self, part: str) -> float:
        """``part``'s share of the step ("compute", "communication", "waiting", "other")."""
        return getattr(self, f"{part}_ms") / self.step_ms if self.step_ms else 0.0


@dataclass(frozen=True)
class ProfileReport:
    """What ``%%distrain --profile`` measured (``result.profile``).

    Attributes
    ----------
    ranks : tuple of RankProfile
        Per rank: the step time and its split into computation, communication (not overlapped),
        waiting for peers and other time, in ms per step, and the top operators by self time.
    device : str
        ``"cpu"`` (operators, gloo's collectives) or ``"cuda"`` (kernels, NCCL's).
    folder : str or None
        Where the Chrome traces (one per rank, gzip) were written.
    skipped : int
        Optimizer steps run before the window.
    notes : tuple of str
        What limits the numbers (e.g. collectives that differ between ranks: waiting not split).
    """

    ranks: tuple[RankProfile, ...]
    device: str
    folder: str | None
    skipped: int
    notes: tuple[str, ...] = ()
    lanes: tuple[dict[str, Any], ...] = field(default=(), repr=False)  # the timeline's drawing

    def table(self) -> str:
        head = (
            f"{'rank':>4}  {'step ms':>8}  {'compute':>12}  {'communication':>13}  "
            f"{'waiting':>12}  {'other':>12}  {'overlapped':>10}"
        )
        rows = [head]
        for r in self.ranks:
            cells = [
                f"{getattr(r, f'{p}_ms'):6.1f} {r.share(p):4.0%}".rjust(w)
                for p, w in zip(PARTS, (12, 13, 12, 12), strict=True)
            ]
            rows.append(
                f"{r.rank:>4}  {r.step_ms:>8.1f}  {'  '.join(cells)}  {r.overlapped_ms:>7.1f} ms"
            )
        return "\n".join(rows)

    def top_text(self, limit: int = 5) -> str:
        shown = self.ranks if len(self.ranks) <= 4 else _rank0_and_slowest(self.ranks)
        lines = []
        for r in shown:
            # No-break spaces inside an item: a narrow output wraps between items, not in a
            # number ("0.1⏎ms", seen in JupyterLab).
            ops = ", ".join(f"{name}\u00a0{ms:.1f}\u00a0ms" for name, ms, _ in r.top_ops[:limit])
            lines.append(f"  rank {r.rank}: {ops}")
        return "\n".join(lines)

    def text(self) -> str:
        steps = self.ranks[0].steps if self.ranks else 0
        out = [
            f"nbdist: profile of {steps} step{'s' if steps != 1 else ''} per rank (after "
            f"{self.skipped} warm-up steps; {self.device}); ms per step and share of the step:",
            self.table(),
            "top operators by self time (ms per step):",
            self.top_text(),
        ]
        out.extend(f"note: {n}" for n in self.notes)
        if steps:
            out.append(
                f"note: the throughput dips over steps {self.skipped}-{self.skipped + steps - 1}"
                ": that is the profiler's own cost while it records, not the model's"
            )
        if self.folder:
            out.append(
                f"Chrome traces (open in https://ui.perfetto.dev or TensorBoard): {self.folder}/"
            )
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"<ProfileReport {len(self.ranks)} ranks>\n{self.table()}"


def _rank0_and_slowest(ranks: Sequence[RankProfile]) -> list[RankProfile]:
    slowest = max(ranks, key=lambda r: r.compute_ms)
    return [ranks[0]] if slowest is ranks[0] else [ranks[0], slowest]


def analyse(windows: dict[int, dict[str, Any]], *, skipped: int) -> ProfileReport:
    """Combine the ranks' windows (rank -> what ``nbdist.engine.profiling`` sent)."""
    ranks = sorted(windows)
    notes: list[str] = []
    comm = {r: _in_window(windows[r]) for r in ranks}
    counts = {len(c) for c in comm.values()}
    transfer: list[float] | None = None
    if len(counts) == 1:
        n = counts.pop()
        transfer = [min(c[i][2] - c[i][1] for c in comm.values()) for i in range(n)]
    else:
        notes.append(
            "the ranks ran different numbers of collectives in their windows: waiting is not "
            "split from communication"
        )
    profiles, lanes = [], []
    for r in ranks:
        w = windows[r]
        steps = [tuple(s) for s in w["steps"]]
        window = merge(steps)
        n = len(steps)
        compute = intersect(merge([tuple(c) for c in w["compute"]]), window)
        spans, waits = [], []
        for i, (_, start, end) in enumerate(comm[r]):
            moved = transfer[i] if transfer is not None else end - start
            spans.append((max(start, end - moved), end))
            waits.append((start, max(start, end - moved)))
        spans_m, waits_m = intersect(merge(spans), window), intersect(merge(waits), window)
        exposed = subtract(spans_m, compute)
        waiting = subtract(subtract(waits_m, compute), spans_m)
        busy = merge([*compute, *spans_m, *waits_m])
        total = length(window)
        per = 1000.0 * max(n, 1)  # µs over the window -> ms per step
        profiles.append(
            RankProfile(
                rank=r,
                steps=n,
                step_ms=total / per,
                compute_ms=length(compute) / per,
                communication_ms=length(exposed) / per,
                overlapped_ms=length(intersect(spans_m, compute)) / per,
                waiting_ms=length(waiting) / per,
                other_ms=(total - length(busy)) / per,
                top_ops=tuple(
                    (name, us / per, calls / max(n, 1)) for name, us, calls in w.get("top", ())
                ),
            )
        )
        lanes.append(
            {
                "rank": r,
                "window": window,
                "starts": [start for start, _ in steps],
                "compute": compute,
                "communication": spans_m,
                "waiting": waiting,
                "ends": [end for _, _, end in comm[r]],
            }
        )
    return ProfileReport(
        ranks=tuple(profiles), device=windows[ranks[0]].get("device", "cpu"), folder=None,
        skipped=skipped, notes=tuple(notes), lanes=tuple(lanes),
    )  # fmt: skip


def _in_window(w: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The collectives that started inside the rank's profiled steps, in order."""
    window = merge([tuple(s) for s in w["steps"]])
    if not window:
        return []
    first, last = window[0][0], window[-1][1]
    return [(c[0], c[1], c[2]) for c in w["comm"] if first <= c[1] < last]


def timeline_png(report: ProfileReport) -> bytes:
    """One lane per rank over the profiled steps: computation, communication and waiting.
    Lanes are aligned on the ends of their collectives (a collective ends on every rank at about
    the same moment), else on their first step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lanes = list(report.lanes[:MAX_LANES])
    offsets = _offsets(lanes)
    fig = Figure(figsize=(9, 0.9 + 0.42 * len(lanes)), dpi=72)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colours = {"compute": "#4c72b0", "communication": "#dd8452", "waiting": "#c44e52"}
    for y, (lane, offset) in enumerate(zip(lanes, offsets, strict=True)):

        def ms(iv: Intervals) -> list[tuple[float, float]]:
            return [((s - offset) / 1000.0, (e - s) / 1000.0) for s, e in iv]  # noqa: B023

        ax.broken_barh(ms(lane["window"]), (y - 0.4, 0.8), facecolors="#eeeeee")
        for part, colour in colours.items():
            ax.broken_barh(ms(lane[part]), (y - 0.35, 0.7), facecolors=colour, label=part)
        starts = [(start - offset) / 1000.0 for start in lane["starts"]]
        ax.vlines(starts, y - 0.45, y + 0.45, color="#555555", linewidth=0.8)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    ax.legend(
        seen.values(), seen.keys(), loc="lower right", bbox_to_anchor=(1.0, 1.0),
        fontsize="small", ncol=3, frameon=False,
    )  # fmt: skip
    ax.set_yticks(range(len(lanes)), [f"rank {lane['rank']}" for lane in lanes])
    ax.set_ylim(len(lanes) - 0.5 + 0.6, -0.6)
    ax.set_xlabel("ms; ticks: each rank's steps; grey: the rest of a step (Python, data, ...)")
    extra = len(report.lanes) - len(lanes)
    more = f" (first {len(lanes)} of {len(report.lanes)} ranks)" if extra > 0 else ""
    ax.set_title(f"where the time goes, per rank{more}", loc="left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _offsets(lanes: list[dict[str, Any]]) -> list[float]:
    if not lanes:
        return []

    def start(lane: dict[str, Any]) -> float:
        return lane["window"][0][0] if lane["window"] else 0.0

    ends0, w0 = lanes[0]["ends"], start(lanes[0])
    offsets = []
    for lane in lanes:
        ends = lane["ends"]
        if ends and len(ends) == len(ends0):
            diffs = sorted(e - e0 for e, e0 in zip(ends, ends0, strict=True))
            shift = diffs[len(diffs) // 2]
        else:
            shift = start(lane) - w0
        offsets.append(shift + w0)
    return offsets


def trace_name(cell: str, rank: int) -> str:
    """A rank's trace file, named after the cell too (``In12-rank0.pt.trace.json.gz``): a
    trace copied elsewhere still says which cell it is of."""
    return f"{cell}-rank{rank}.pt.trace.json.gz"


def write_traces(traces: dict[int, bytes], cell: str, base: str | None = None) -> str:
    """Each rank's Chrome trace (:func:`trace_name`) in a new folder of this user's under
    ``base/nbdist-profile`` (the notebook's folder), named after the cell (``cell``: ``In12``
    for ``In [12]``) and the time; returns the folder. The folders are this user's alone
    (0700, never a link, another user's, or one others can read or write), like nbdist's
    other files."""
    root = os.path.join(base or os.getcwd(), FOLDER)
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        info = os.lstat(root)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(
                f"{root} is not a folder of this user's; traces not written (remove it, or "
                "run the notebook from a folder of your own)"
            ) from None
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise PermissionError(
                f"{root} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); traces "
                f"not written: chmod 700 {root}"
            ) from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = os.path.join(root, f"{cell}-{stamp}")
    suffix = 1
    while True:
        try:
            os.mkdir(folder if suffix == 1 else f"{folder}-{suffix}", 0o700)
            folder = folder if suffix == 1 else f"{folder}-{suffix}"
            break
        except FileExistsError:
            suffix += 1
    for rank, data in sorted(traces.items()):
        path = os.path.join(folder, trace_name(cell, rank))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return os.path.relpath(folder) if base is None else folder


def trace_events(path: str) -> list[dict[str, Any]]:
    """The events of a trace file written here (tests and the curious)."""
    import json

    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def from_reports(
    windows: dict[int, dict[str, Any] | None], cell: str, *, skipped: int
) -> tuple[ProfileReport | None, str]:
    """The profile of a finished cell (rank -> the window its report carries; ``cell``: its
    name in file names, ``In12``) and the text to show: the breakdown, or why there is none."""
    errors = {r: w["error"] for r, w in windows.items() if w is not None and "error" in w}
    if errors:
        rank, error = min(errors.items())
        return None, f"nbdist: --profile: rank {rank} could not summarise its profile ({error})"
    done = {r: w for r, w in windows.items() if w is not None and w.get("steps")}
    if len(done) < len(windows):
        return None, (
            f"nbdist: --profile: no step was profiled on rank {min(set(windows) - set(done))}: "
            f"the window opens after {skipped} optimizer steps (optimizer.step() calls); run more "
            "steps in the cell"
        )
    traces = {r: w.pop("trace") for r, w in done.items() if w.get("trace")}
    report = analyse(done, skipped=skipped)
    notes = list(report.notes)
    folder = None
    try:
        folder = write_traces(traces, cell)
    except OSError as e:
        notes.append(f"traces not written: {e}")
    ranks = tuple(
        replace(r, trace=os.path.join(folder, trace_name(cell, r.rank)) if folder else None)
        for r in report.ranks
    )
    report = replace(report, ranks=ranks, folder=folder, notes=tuple(notes))
    return report, report.text()
