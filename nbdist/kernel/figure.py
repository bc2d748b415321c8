"""The figure of a run: loss vs step (mean over ranks, min–max band, the session's earlier cells
fainter) and samples/s (total and per rank; beyond ``MANY_RANKS`` ranks, the ranks' mean with
a min–max band, the total in the title). matplotlib is imported when one is made."""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from nbdist.kernel.curves import LOG_DECADES, TOO_SHORT, Aggregate, Segment
from nbdist.ranks import MANY_RANKS

if TYPE_CHECKING:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

MAX_POINTS = 2000
# 864 x 288 pixels: 10-point titles are ~13 px, readable where the notebook shows the picture at
# its own size (the live image and the final one alike: nothing jumps when one replaces the
# other).
DPI = 96
SIZE_INCHES = (9.0, 3.0)
FIGURE_TEXT = "<nbdist figure: loss and throughput>"
LOSS_TITLE = "loss (mean over ranks, min–max band)"
EARLIER = "; pale: earlier cells"
RATE_TITLE = "throughput (samples/s)"
SESSION_STEPS = "step in the session"
BAND_TITLE = "samples/s per rank (mean, min–max band)"


def png_data(png: bytes | bytearray | memoryview) -> str:
    """PNG bytes as a display bundle carries them: base64 text, as nbformat stores them.

    The live image widget may hand its value back as a ``memoryview``: put in a bundle as it is,
    it was sent as a JSON list of numbers, a broken image in JupyterLab and a notebook that
    fails validation when saved.
    """
    return base64.b64encode(bytes(png)).decode("ascii")


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


def use_log_scale(agg: Aggregate, logy: bool | None) -> bool:
    """``logy`` when given; otherwise whether the mean loss spans more than LOG_DECADES."""
    if logy is not None:
        return logy
    decades = agg.loss_decades()
    return decades is not None and decades > LOG_DECADES


def _kept(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    keep = downsample(xs)
    return [xs[i] for i in keep], [ys[i] for i in keep]


class Figure:
    """Kept between redraws, and between cells (:func:`figure_for`): only line data changes
    per redraw, which keeps one redraw to a few tens of milliseconds (the kernel shares the
    machine's cores with the workers; making the figure costs as much again)."""

    def __init__(self, world: int, *, dpi: int = DPI) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure as MplFigure
        from matplotlib.ticker import FormatStrFormatter

        self.fig = MplFigure(figsize=SIZE_INCHES, dpi=dpi)
        FigureCanvasAgg(self.fig)
        # Room on the right for the throughput's legend, beside its lines, never over them.
        right = 0.98 if world > MANY_RANKS else 0.89
        self.fig.subplots_adjust(left=0.07, right=right, bottom=0.17, top=0.9, wspace=0.25)
        self.ax_loss, self.ax_rate = self.fig.subplots(1, 2)
        # Titles at a fixed height: placed automatically, they cost a layout pass (~15 ms) a draw.
        self.world = world
        self.banded = world > MANY_RANKS
        self.ax_rate.set_title(BAND_TITLE if self.banded else RATE_TITLE, y=1.0, fontsize=10)
        self.ax_loss.set_xlabel("step")
        self.ax_rate.set_xlabel("seconds")
        (self.earlier_line,) = self.ax_loss.plot(
            [], [], color="C0", alpha=0.35, label="earlier cells"
        )
        (self.mean_line,) = self.ax_loss.plot([], [], color="C0", label="this cell")
        self._log_format = FormatStrFormatter("%g")  # mathtext labels cost ~10 ms each draw
        self.band = None
        self.rate_band = None
        if self.banded:  # one line and a band however many ranks: no legend, no line per rank
            (self.total_line,) = self.ax_rate.plot([], [], color="C1")
            self.rank_lines = []
        else:
            (self.total_line,) = self.ax_rate.plot([], [], color="black", label="total")
            self.rank_lines = [
                self.ax_rate.plot([], [], alpha=0.6, label=f"rank {r}")[0] for r in range(world)
            ]
            self.ax_rate.legend(
                loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False,
                borderaxespad=0.0, handlelength=1.2,
            )  # fmt: skip
        self.note = self.ax_rate.text(
            0.5, 0.5, "", transform=self.ax_rate.transAxes, ha="center", va="center", color="0.4"
        )
        self.reset()

    def reset(self, earlier: Sequence[Segment] = ()) -> None:
        """Empty, for a new cell; ``earlier`` are the session's earlier cells, drawn fainter."""
        xs: list[float] = []
        ys: list[float] = []
        for seg in earlier:  # one line, broken between cells
            sx, sy = _kept(seg.steps, seg.loss)
            xs += [*sx, math.nan]
            ys += [*sy, math.nan]
        self.earlier_line.set_data(xs, ys)
        # In the title, not a legend: a legend costs ~15 ms a draw.
        self.ax_loss.set_title(LOSS_TITLE + (EARLIER if earlier else ""), y=1.0, fontsize=10)
        # The steps' count, as the table and the summary label it.
        self.ax_loss.set_xlabel(SESSION_STEPS if earlier else "step")
        self.mean_line.set_data([], [])
        if self.band is not None:
            self.band.remove()
            self.band = None
        if self.rate_band is not None:
            self.rate_band.remove()
            self.rate_band = None
        if self.banded:
            self.ax_rate.set_title(BAND_TITLE, y=1.0, fontsize=10)
        for line in (self.total_line, *self.rank_lines):
            line.set_data([], [])
        self.note.set_text("")

    def draw(self, agg: Aggregate, smoothing: float = 1.0, logy: bool | None = None) -> None:
        """Set the lines from ``agg``."""
        steps, mean, lo, hi = agg.loss_curve()
        if steps:
            keep = downsample(steps)
            xs = [steps[i] for i in keep]
            smooth = ema(mean, smoothing)
            self.mean_line.set_data(xs, [smooth[i] for i in keep])
            if self.band is not None:
                self.band.remove()
            self.band = self.ax_loss.fill_between(
                xs, [lo[i] for i in keep], [hi[i] for i in keep], alpha=0.25, color="C0"
            )
        if use_log_scale(agg, logy):
            self.ax_loss.set_yscale("log")
            self.ax_loss.minorticks_off()
            self.ax_loss.yaxis.set_major_formatter(self._log_format)
        else:
            self.ax_loss.set_yscale("linear")
        if self.banded:
            times = self._draw_band(agg)
        else:
            times, total, per_rank = agg.throughput_curve()
            few = len(times) < 3  # a line needs points to be seen: mark each one
            self.total_line.set_data(*_kept(times, total))
            self.total_line.set_marker("o" if few else "None")
            for line, (xs_r, ys_r) in zip(self.rank_lines, per_rank, strict=True):
                line.set_data(*_kept(xs_r, ys_r))
                line.set_marker("o" if len(xs_r) < 3 else "None")
        self.note.set_text("" if times else TOO_SHORT)
        for ax in (self.ax_loss, self.ax_rate):
            ax.relim()
            ax.autoscale_view()

    def _draw_band(self, agg: Aggregate) -> list[float]:
        """The ranks' samples/s as a mean line in a min–max band; the total in the title."""
        assert agg.bands is not None
        times, mean, lo, hi, total = agg.bands.curve()
        if self.rate_band is not None:
            self.rate_band.remove()
            self.rate_band = None
        keep = downsample(times)
        xs = [times[i] for i in keep]
        self.total_line.set_data(xs, [mean[i] for i in keep])
        self.total_line.set_marker("o" if len(xs) < 3 else "None")
        if xs:
            self.rate_band = self.ax_rate.fill_between(
                xs, [lo[i] for i in keep], [hi[i] for i in keep], alpha=0.25, color="C1"
            )
            title = f"{BAND_TITLE}; total {total[-1]:,.0f}"
        else:
            title = BAND_TITLE
        self.ax_rate.set_title(title, y=1.0, fontsize=10)
        return times

    @property
    def width_px(self) -> int:
        """The picture's width in pixels, as the notebook should show it."""
        return round(self.fig.get_figwidth() * self.fig.dpi)

    def png(self, agg: Aggregate, smoothing: float = 1.0, logy: bool | None = None) -> bytes:
        self.draw(agg, smoothing, logy)
        buf = io.BytesIO()
        cast("FigureCanvasAgg", self.fig.canvas).print_png(buf)
        return buf.getvalue()


_FIGURES: dict[int, Figure] = {}


def figure_for(world: int, earlier: Sequence[Segment] = ()) -> Figure:
    """The figure for a cell on ``world`` ranks, reset: one is kept per world size (the
    cells of one kernel run one at a time, and what a cell shows is PNG bytes, not the
    figure)."""
    figure = _FIGURES.get(world)
    if figure is None:
        figure = _FIGURES[world] = Figure(world)
    figure.reset(earlier)
    return figure
