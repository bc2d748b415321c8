"""The live panel of a ``%%distrain`` run, and the static figure and summary it leaves behind.

Sink only: the runner feeds it metric points and rank states; it draws. Redraws are throttled by
wall clock (``REDRAW_S``) however fast points arrive, every series is cut to ``MAX_POINTS`` before
plotting, and the panel is updated in place (one widget, no ``clear_output``). ipywidgets and
matplotlib are imported only when a panel is made.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

REDRAW_S = 0.5
# The kernel shares the cores with the workers: the figure (the costly part, ~0.1 s a draw on a
# small machine) is redrawn only as often as keeps it under this fraction of one core.
FIGURE_CPU_BUDGET = 0.05
MAX_POINTS = 2000
RATE_WINDOW_S = 2.0
PANEL_TEXT = "nbdist live panel (loss and throughput per rank; shown live in Jupyter)"


def downsample(xs: Sequence[float], max_points: int = MAX_POINTS) -> list[int]:
    """Indices of at most ``max_points`` evenly spread items, always keeping the last one."""
    n = len(xs)
    if n <= max_points:
        return list(range(n))
    stride = math.ceil(n / max_points)
    keep = list(range(0, n, stride))
    if keep[-1] != n - 1:
        keep[-1] = n - 1
    return keep


def ema(values: Sequence[float], alpha: float) -> list[float]:
    """Exponential moving average; ``alpha`` in (0, 1], 1 means no smoothing."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


@dataclass
class Throttle:
    """Says yes at most once every ``interval`` seconds of wall clock."""

    interval: float = REDRAW_S
    clock: Callable[[], float] = time.monotonic
    _last: float = -math.inf

    def ready(self, force: bool = False) -> bool:
        now = self.clock()
        if force or now - self._last >= self.interval:
            self._last = now
            return True
        return False


@dataclass
class Aggregate:
    """Running per-step and per-rank summaries of the metric points of one run."""

    world: int
    start: float = field(default_factory=time.time)
    loss: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> loss
    samples: list[list[tuple[float, float]]] = field(init=False)  # per rank: (time, samples)
    last: list[dict[str, Any]] = field(init=False)
    total_steps: int | None = None
    seen: int = 0

    def __post_init__(self) -> None:
        self.samples = [[] for _ in range(self.world)]
        self.last = [{} for _ in range(self.world)]

    def add(self, history: Sequence[dict[str, Any]]) -> None:
        """Take in the points of ``history`` not seen yet."""
        for point in history[self.seen :]:
            rank = point["rank"]
            if "loss" in point:
                self.loss.setdefault(point["step"], {})[rank] = float(point["loss"])
            if "samples" in point:
                self.samples[rank].append((point["time"], float(point["samples"])))
            self.last[rank] = {**self.last[rank], **point}
        self.seen = len(history)

    def loss_curve(self) -> tuple[list[int], list[float], list[float], list[float]]:
        """Steps, and the mean, min and max of the ranks' losses at each."""
        steps = sorted(self.loss)
        values = [list(self.loss[s].values()) for s in steps]
        return (
            steps,
            [sum(v) / len(v) for v in values],
            [min(v) for v in values],
            [max(v) for v in values],
        )

    def rate(self, rank: int, now: float | None = None) -> float | None:
        """Samples per second of ``rank`` over the last ``RATE_WINDOW_S`` seconds it logged."""
        pts = self.samples[rank]
        if len(pts) < 2:
            return None
        end = pts[-1][0] if now is None else now
        window = [p for p in pts[-2000:] if p[0] >= end - RATE_WINDOW_S]
        if len(window) < 2:
            window = pts[-2:]
        span = window[-1][0] - window[0][0]
        return sum(n for _, n in window[1:]) / span if span > 0 else None

    def throughput_curve(self) -> tuple[list[float], list[float], list[list[float]]]:
        """Bin centres (seconds since start), total samples/s, and samples/s per rank."""
        times = [t for pts in self.samples for t, _ in pts]
        if len(times) < 2:
            return [], [], [[] for _ in range(self.world)]
        t0, t1 = min(times), max(times)
        width = max((t1 - t0) / 100, 0.25)
        # Whole bins only: a last, partly filled bin would show a drop that is not there.
        bins = max(1, math.floor((t1 - t0) / width))
        per_rank = [[0.0] * bins for _ in range(self.world)]
        for rank, pts in enumerate(self.samples):
            for t, n in pts[1:]:
                index = int((t - t0) / width)
                if index == bins and t - t0 <= bins * width + 1e-9:
                    index = bins - 1  # the last bin's closed end
                if index < bins:
                    per_rank[rank][index] += n / width
        centres = [t0 - self.start + (i + 0.5) * width for i in range(bins)]
        total = [sum(col) for col in zip(*per_rank, strict=True)]
        return centres, total, per_rank

    def summary(self, wall: float, framework: str, detail: str = "") -> str:
        """One line: final loss, total and mean throughput, wall time, workers."""
        parts = []
        steps, mean, _, _ = self.loss_curve()
        if steps:
            parts.append(f"final loss {mean[-1]:.4g} (step {steps[-1]}, mean over ranks)")
        samples = sum(n for pts in self.samples for _, n in pts)
        if samples and wall > 0:
            total = samples / wall
            parts.append(
                f"{total:,.0f} samples/s total, {total / self.world:,.0f} per rank "
                f"({samples:,.0f} samples)"
            )
        parts.append(f"wall {wall:.1f} s")
        parts.append(f"{self.world} worker{'s' if self.world > 1 else ''} ({framework}{detail})")
        return "nbdist: " + " · ".join(parts)


class Figure:
    """The figure, kept between redraws: loss vs step (mean over ranks, min–max band) and
    samples/s (total and per rank). Only line data changes per redraw, which keeps one redraw
    to a few tens of milliseconds: the kernel shares the machine's cores with the workers."""

    def __init__(self, world: int, *, dpi: int = 72) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure as MplFigure

        self.fig = MplFigure(figsize=(9, 3), dpi=dpi)
        FigureCanvasAgg(self.fig)
        self.fig.subplots_adjust(left=0.07, right=0.98, bottom=0.17, top=0.9, wspace=0.25)
        self.ax_loss, self.ax_rate = self.fig.subplots(1, 2)
        self.ax_loss.set(title="loss", xlabel="step")
        self.ax_rate.set(title="throughput (samples/s)", xlabel="seconds")
        (self.mean_line,) = self.ax_loss.plot([], [], label="mean over ranks")
        self.band = None
        (self.total_line,) = self.ax_rate.plot([], [], color="black", label="total")
        self.rank_lines = [
            self.ax_rate.plot([], [], alpha=0.6, label=f"rank {r}")[0] for r in range(world)
        ]
        self.ax_rate.legend(loc="lower right", fontsize="small")

    def png(self, agg: Aggregate, smoothing: float = 1.0) -> bytes:
        steps, mean, lo, hi = agg.loss_curve()
        if steps:
            keep = downsample(steps)
            xs = [steps[i] for i in keep]
            smooth = ema(mean, smoothing)
            self.mean_line.set_data(xs, [smooth[i] for i in keep])
            if self.band is not None:
                self.band.remove()
            else:
                self.ax_loss.legend(handles=[self.mean_line], loc="upper right", fontsize="small")
            self.band = self.ax_loss.fill_between(
                xs, [lo[i] for i in keep], [hi[i] for i in keep], alpha=0.25, color="C0"
            )
        centres, total, per_rank = agg.throughput_curve()
        if centres:
            keep = downsample(centres)
            xs = [centres[i] for i in keep]
            self.total_line.set_data(xs, [total[i] for i in keep])
            for line, series in zip(self.rank_lines, per_rank, strict=True):
                line.set_data(xs, [series[i] for i in keep])
        for ax in (self.ax_loss, self.ax_rate):
            ax.relim()
            ax.autoscale_view()
        buf = io.BytesIO()
        self.fig.canvas.print_png(buf)
        return buf.getvalue()


def _eta(last: dict[str, Any], total: int | None, elapsed: float) -> str:
    step = last.get("step")
    if total is None or step is None or step <= 0:
        return ""
    remaining = max(0, total - step - 1)
    return f"{remaining * elapsed / (step + 1):.0f} s"


def table_html(agg: Aggregate, states: Sequence[str], now: float) -> str:
    """One row per rank: state, step, last loss, samples/s, elapsed, ETA."""
    rows = []
    elapsed = now - agg.start
    for rank in range(agg.world):
        last = agg.last[rank]
        rate = agg.rate(rank)
        loss = last.get("loss")
        rows.append(
            "<tr>"
            f"<td>{rank}</td><td>{states[rank]}</td><td>{last.get('step', '')}</td>"
            f"<td>{'' if loss is None else f'{loss:.4g}'}</td>"
            f"<td>{'' if rate is None else f'{rate:,.0f}'}</td>"
            f"<td>{elapsed:.1f} s</td><td>{_eta(last, agg.total_steps, elapsed)}</td>"
            "</tr>"
        )
    head = "".join(
        f"<th>{h}</th>" for h in ("rank", "state", "step", "loss", "samples/s", "elapsed", "ETA")
    )
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


# The Stop button asks the Jupyter server to interrupt this kernel. A widget click would travel
# as a comm message on the shell channel, which a kernel busy running the cell does not read
# (ipykernel 7 only serves comms to async cells); the interrupt reaches the cell at once, as a
# KeyboardInterrupt in nbdist's wait loop, which stops every rank.
_STOP_JS = (
    "this.disabled=true;this.textContent='Stopping...';"
    "var c=document.getElementById('jupyter-config-data');"
    "var cfg=c?JSON.parse(c.textContent):{};"
    "var h={};var x=document.cookie.match(/_xsrf=([^;]+)/);"
    "if(x){h['X-XSRFToken']=decodeURIComponent(x[1]);}"
    "if(cfg.token){h['Authorization']='token '+cfg.token;}"
    "var b=this;var fail=function(why){b.disabled=false;"
    "b.textContent='Stop failed ('+why+'): use Kernel > Interrupt';};"
    "fetch((cfg.baseUrl||'/')+'PATH',{method:'POST',credentials:'same-origin',headers:h})"
    ".then(function(r){if(!r.ok){fail('HTTP '+r.status);}},function(e){fail(String(e));});"
)
_BUTTON_STYLE = (
    "background:#d32f2f;color:white;border:none;border-radius:3px;padding:4px 14px;"
    "font-size:13px;cursor:pointer"
)


def stop_button_html(interrupt_path: str | None, *, stopped: bool = False) -> str:
    """The Stop button: POSTs to ``interrupt_path`` (the server's kernel interrupt URL)."""
    if stopped or interrupt_path is None:
        label = "Stopped" if stopped else "Stop: use Kernel > Interrupt"
        return f'<button disabled style="{_BUTTON_STYLE};opacity:0.5">{label}</button>'
    onclick = _STOP_JS.replace("PATH", interrupt_path)
    return f'<button class="nbdist-stop" style="{_BUTTON_STYLE}" onclick="{onclick}">Stop</button>'


class Dashboard:
    """The live panel: a table row per rank, the figure, and a Stop button.

    Shown once through ``display`` with a fixed text/plain (a saved or headless-run notebook shows
    one stable line for it), then updated in place.
    """

    def __init__(
        self, agg: Aggregate, *, interrupt_path: str | None, display: Callable[..., Any]
    ) -> None:
        import ipywidgets as widgets

        self.agg = agg
        self.figure = Figure(agg.world)
        self._next_figure = 0.0
        self.interrupt_path = interrupt_path
        self.table = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.stop = widgets.HTML(stop_button_html(interrupt_path))
        self.box = widgets.VBox([self.table, self.image, self.stop])
        display(
            {
                "application/vnd.jupyter.widget-view+json": {
                    "model_id": self.box.model_id,
                    "version_major": 2,
                    "version_minor": 0,
                },
                "text/plain": PANEL_TEXT,
            },
            raw=True,
        )

    def draw(self, states: Sequence[str], smoothing: float, *, force: bool = False) -> None:
        self.table.value = table_html(self.agg, states, time.time())
        now = time.monotonic()
        if force or now >= self._next_figure:
            self.image.value = self.figure.png(self.agg, smoothing)
            took = time.monotonic() - now
            self._next_figure = now + max(REDRAW_S, took / FIGURE_CPU_BUDGET)

    def close(self) -> None:
        self.stop.value = stop_button_html(self.interrupt_path, stopped=True)


class LiveView:
    """What a run shows: nothing until a metric arrives, then the live panel (unless
    ``plot=False``), and at the end the static figure and a one-line summary.

    Parameters
    ----------
    world : int
        Number of ranks.
    plot : bool
        Live panel and final figure; False leaves the summary line only.
    smoothing : float
        EMA factor for the loss curve (1 = none).
    display : callable
        IPython's ``display``.
    interrupt_path : str or None
        The Jupyter server's interrupt URL for this kernel (``api/kernels/<id>/interrupt``),
        which the Stop button calls; None outside Jupyter.
    expect_metrics : bool
        Show the panel at once (the cell will log), instead of at the first metric.
    """

    def __init__(
        self,
        world: int,
        *,
        plot: bool,
        smoothing: float,
        display: Callable[..., Any],
        interrupt_path: str | None = None,
        expect_metrics: bool = False,
    ) -> None:
        self.agg = Aggregate(world)
        self.plot, self.smoothing = plot, smoothing
        self._display, self._interrupt_path = display, interrupt_path
        self.throttle = Throttle()
        self.dashboard: Dashboard | None = None
        self.redraws = 0
        if plot and expect_metrics:
            # Shown before the cell's first output, so the panel's place in the outputs does not
            # depend on whether a print or a metric arrived first.
            self.dashboard = Dashboard(self.agg, interrupt_path=interrupt_path, display=display)

    def update(
        self,
        history: Sequence[dict[str, Any]],
        states: Sequence[str],
        *,
        total_steps: int | None = None,
        force: bool = False,
    ) -> bool:
        """Take in new points; redraw if the throttle allows. Returns whether it redrew."""
        self.agg.add(history)
        if total_steps is not None:
            self.agg.total_steps = total_steps
        if not history or not self.plot or not self.throttle.ready(force):
            return False
        if self.dashboard is None:
            self.dashboard = Dashboard(
                self.agg, interrupt_path=self._interrupt_path, display=self._display
            )
        self.dashboard.draw(states, self.smoothing, force=force)
        self.redraws += 1
        return True

    def finish(
        self,
        history: Sequence[dict[str, Any]],
        states: Sequence[str],
        *,
        wall: float,
        framework: str,
        detail: str = "",
    ) -> str | None:
        """Final redraw, the static figure and the summary line (returned); None without metrics."""
        if not history:
            return None
        self.agg.add(history)
        if self.plot:
            figure = self.dashboard.figure if self.dashboard else Figure(self.agg.world)
            png = figure.png(self.agg, self.smoothing)  # drawn once: live panel and static copy
            if self.dashboard is not None:
                self.dashboard.table.value = table_html(self.agg, states, time.time())
                self.dashboard.image.value = png
                self.dashboard.close()
            self._display(
                {"image/png": png, "text/plain": "<nbdist figure: loss and throughput>"},
                raw=True,
            )
        return self.agg.summary(wall, framework, detail)
