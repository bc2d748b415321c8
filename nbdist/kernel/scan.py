"""``%%distrain --scan 1,2,...``: run a cell with each worker count and show how it scales."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nbdist.kernel.breakdown import PARTS as _PARTS
from nbdist.kernel.figure import png_data
from nbdist.kernel.result import DistrainResult


def throughput(result: DistrainResult) -> tuple[float, str]:
    """Total samples/s of a run (samples recorded by every rank over its wall time), or runs/s
    (``1 / wall``) when the cell recorded no samples: then speedup is a ratio of wall times."""
    samples = sum(float(p["samples"]) for p in result.history if "samples" in p)
    if samples > 0 and result.wall > 0:
        return samples / result.wall, "samples/s"
    return 1.0 / result.wall, "runs/s"


@dataclass(frozen=True)
class ScanResult:
    """What ``%%distrain --scan`` measured: one run per worker count.

    Attributes
    ----------
    workers : tuple of int
        The worker counts, in the order they ran.
    runs : tuple of DistrainResult
        Each run's full result.
    throughput : tuple of float
        Each run's total throughput, in ``unit``.
    unit : str
        ``"samples/s"`` (from ``log(samples=...)`` or autolog), or ``"runs/s"`` when the cell
        recorded no samples.
    """

    workers: tuple[int, ...]
    runs: tuple[DistrainResult, ...]
    throughput: tuple[float, ...]
    unit: str

    @property
    def speedup(self) -> list[float]:
        """Throughput relative to the first worker count's."""
        return [t / self.throughput[0] for t in self.throughput]

    @property
    def efficiency(self) -> list[float]:
        """Speedup over the ideal one (worker count relative to the first); 1.0 is perfect."""
        return [s * self.workers[0] / n for s, n in zip(self.speedup, self.workers, strict=True)]

    @property
    def ideal(self) -> list[float]:
        """Throughput with perfect scaling from the first run."""
        return [self.throughput[0] * n / self.workers[0] for n in self.workers]

    @property
    def profiles(self) -> list[Any]:
        """Each run's ``--profile`` breakdown (None where it has none)."""
        return [r.profile for r in self.runs]

    def table(self) -> str:
        profiled = bool(self.runs) and all(p is not None for p in self.profiles)
        head = f"{'workers':>7}  {self.unit:>12}  {'speedup':>7}  {'efficiency':>10}"
        if profiled:  # where the step time goes, the mean over the run's ranks
            head += f"  {'compute':>7}  {'comm':>5}  {'waiting':>7}  {'other':>5}"
        rows = [head]
        for i, (n, t, s, e) in enumerate(
            zip(self.workers, self.throughput, self.speedup, self.efficiency, strict=True)
        ):
            row = f"{n:>7}  {t:>12,.1f}  {s:>6.2f}x  {e:>10.0%}"
            if profiled:
                ranks = self.profiles[i].ranks
                shares = [sum(r.share(p) for r in ranks) / len(ranks) for p in _PARTS]
                row += "  " + "  ".join(
                    f"{v:>{w}.0%}" for v, w in zip(shares, (7, 5, 7, 5), strict=True)
                )
            rows.append(row)
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"<ScanResult {self.unit}>\n{self.table()}"


def scan_png(scan: ScanResult) -> bytes:
    """Measured throughput against the ideal line, and efficiency per worker count."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3), dpi=72)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.17, top=0.88, wspace=0.3)
    ax, ax_eff = fig.subplots(1, 2)
    ax.plot(scan.workers, scan.ideal, "--", color="gray", label="ideal (linear)")
    ax.plot(scan.workers, scan.throughput, "o-", label="measured")
    ax.set(title=f"throughput ({scan.unit})", xlabel="workers", xticks=scan.workers)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize="small")
    ax_eff.bar([str(n) for n in scan.workers], scan.efficiency)
    ax_eff.axhline(1.0, color="gray", linestyle="--")
    ax_eff.set(title="scaling efficiency", xlabel="workers", ylim=(0, 1.2))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def run_scan(
    run: Callable[[int], DistrainResult],
    counts: Sequence[int],
    *,
    plot: bool,
    display: Callable[..., Any],
    out: Callable[[str], Any],
) -> ScanResult:
    """Run once per worker count (``run(n)``), then show the table (and the figure)."""
    runs = []
    for n in counts:
        out(f"nbdist: scan: {n} worker{'s' if n > 1 else ''}")
        runs.append(run(n))
    measured = [throughput(r) for r in runs]
    units = {unit for _, unit in measured}
    unit = units.pop() if len(units) == 1 else "runs/s"
    values = [
        t if unit == "samples/s" else 1.0 / r.wall for (t, _), r in zip(measured, runs, strict=True)
    ]
    scan = ScanResult(tuple(counts), tuple(runs), tuple(values), unit)
    if plot:
        display(
            {
                "image/png": png_data(scan_png(scan)),
                "text/plain": "<nbdist scan: throughput vs workers>",
            },
            raw=True,
        )
    out(scan.table())
    return scan
