"""The live panel of a ``%%distrain`` run, and the static figure and summary it leaves behind.

Sink only: the job feeds it metric points and rank states; it draws. The cell's panel is one
output with a display id, updated in place (no ``clear_output``): a line of text until the run
has lasted ``REDRAW_S`` (a short cell never builds widgets or draws a live figure), then the
live widgets (a table row per rank, the figure, a Stop button), the table and the figure
redrawn together from the same points (the figure never behind the table), every ``REDRAW_S``
or, where a figure costs more than ``FIGURE_CPU_BUDGET`` of a core, less often; when the run
ends, the static figure replaces the widgets in the same place and at the same size, so a live
notebook shows one figure per cell and a saved or headless one holds the PNG.
ipywidgets and matplotlib are imported only when needed.
"""

from __future__ import annotations

import html
import math
import statistics
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbdist.kernel.curves import Aggregate, Segment, losses_text
from nbdist.kernel.figure import FIGURE_TEXT, Figure, figure_for, png_data, use_log_scale
from nbdist.protocol import Waiting
from nbdist.ranks import MANY_RANKS

REDRAW_S = 0.5
# The kernel shares the cores with the workers: the panel (its figure is the costly part,
# ~0.1 s a draw on a small machine) is redrawn only as often as keeps it under this fraction of
# one core.
FIGURE_CPU_BUDGET = 0.05
# ...but never further apart than this: a first draw is slow (fonts, ticks made once) and a
# busy machine slows any draw, which the budget alone would turn into a panel seconds behind.
FIGURE_MAX_AGE_S = 2.0
# Past MANY_RANKS ranks the figure is a mean with a min-max band (cheap to draw), the notebook
# usually drives machines other than its own, and the ranks flush only every 0.5 s at 512: the
# figure is redrawn with the table, to stay within 2 s of the newest point (benchmarks/scale.py:
# every 1 s still left it 2.02 s behind at worst at 512 ranks).
FIGURE_MAX_AGE_BANDS_S = REDRAW_S
# The panel's place has one text/plain in every state (held place, live widgets, the static
# figure): nbval ignores display updates, so it compares what the place first showed.
PANEL_TEXT = FIGURE_TEXT
SLOWEST_LISTED = 5  # ranks named under the table grouped by host


def figure_wait(took: float, world: int) -> float:
    """Seconds until the next live figure, after one that took ``took`` s to draw: within the
    CPU budget, but at least every ``REDRAW_S`` and at most the figure's age limit."""
    oldest = FIGURE_MAX_AGE_S if world <= MANY_RANKS else FIGURE_MAX_AGE_BANDS_S
    return min(max(REDRAW_S, took / FIGURE_CPU_BUDGET), oldest)


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


def _eta(last: dict[str, Any], total: int | None, elapsed: float) -> str:
    step = last.get("step")
    if total is None or step is None or step <= 0:
        return ""
    remaining = max(0, total - step - 1)
    return f"{remaining * elapsed / (step + 1):.0f} s"


def _where_text(where: Waiting) -> str:
    """``waits in torch.distributed.all_reduce, line 12: dist.all_reduce(t)``"""
    what = f"waits in {where.collective}, " if where.collective else "at "
    return html.escape(f"{what}line {where.line}: {where.line_text}")


def table_html(
    agg: Aggregate,
    states: Sequence[str],
    now: float,
    hosts: Sequence[str] | None = None,
    where: Mapping[int, Waiting] | None = None,
) -> str:
    """One row per rank: state, step, last loss, samples/s, working time per step, elapsed, ETA.

    A rank the others wait for is marked in its working time; one that has not stepped for a
    few seconds says where it is (``where``: the cell line, and the collective it waits in).
    Beyond ``MANY_RANKS`` ranks, one row per host instead (:func:`host_table_html`)."""
    if agg.world > MANY_RANKS:
        return host_table_html(agg, states, now, hosts)
    rows = []
    elapsed = now - agg.start
    slow = dict(agg.stragglers())
    losses = losses_text(
        [None if (v := agg.last[r].get("loss")) is None else float(v) for r in range(agg.world)]
    )
    for rank in range(agg.world):
        last = agg.last[rank]
        rate = agg.rate(rank)
        work = agg.work_per_step(rank)
        work_text = "" if work is None else f"{work * 1e3:,.0f} ms"
        if rank in slow:
            work_text = f"<b>{work_text} ({slow[rank]:.1f}× the others)</b>"
        state = str(states[rank])
        if where and rank in where:
            state += f"<br><small>{_where_text(where[rank])}</small>"
        rows.append(
            "<tr>"
            f"<td>{rank}</td><td>{state}</td><td>{_step_cell(agg, last.get('step'))}</td>"
            f"<td>{losses[rank]}</td>"
            f"<td>{'' if rate is None else f'{rate:,.0f}'}</td><td>{work_text}</td>"
            f"<td>{elapsed:.1f} s</td><td>{_eta(last, agg.total_steps, elapsed)}</td>"
            "</tr>"
        )
    step = "step (cell / session)" if agg.continued else "step"
    head = "".join(
        f"<th>{h}</th>"
        for h in ("rank", "state", step, "loss", "samples/s", "work/step", "elapsed", "ETA")
    )
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _step_cell(agg: Aggregate, step: int | None) -> str:
    """A rank's step in the table: this cell's, and the session's too where they differ."""
    if step is None:
        return ""
    return f"{step} / {step + (agg.offset or 0)}" if agg.continued else str(step)


def _spread(values: Sequence[float], fmt: str) -> str:
    """``min / median / max`` of ``values`` (empty when there are none); the median of
    integers (steps) is one of them, the lower middle one."""
    if not values:
        return ""
    ints = all(isinstance(v, int) for v in values)
    mid = statistics.median_low(values) if ints else statistics.median(values)
    lo, hi = min(values), max(values)
    return " / ".join(format(v, fmt) for v in (lo, mid, hi))


def _counts(states: Sequence[str]) -> str:
    """``"6 running, 2 done"``: how many ranks are in each state, in order of first mention."""
    seen: dict[str, int] = {}
    for s in states:
        seen[s] = seen.get(s, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in seen.items())


def host_table_html(
    agg: Aggregate, states: Sequence[str], now: float, hosts: Sequence[str] | None = None
) -> str:
    """One row per host (in order of its first rank): its ranks' states, and min / median / max
    of their step, loss, samples/s and working time per step; then the slowest ranks by working
    time per step, those the others wait for in bold."""
    hosts = list(hosts) if hosts is not None else ["?"] * agg.world
    elapsed = now - agg.start
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    rows = []
    for host, ranks in groups.items():
        steps = [s for r in ranks if (s := agg.last[r].get("step")) is not None]
        losses = [float(v) for r in ranks if (v := agg.last[r].get("loss")) is not None]
        rates = [v for r in ranks if (v := agg.rate(r)) is not None]
        work = [v * 1e3 for r in ranks if (v := agg.work_per_step(r)) is not None]
        behind = min(ranks, key=lambda r: agg.last[r].get("step", -1))  # its ETA is the host's
        rows.append(
            "<tr>"
            f"<td>{host}</td><td>{len(ranks)}</td><td>{_counts([states[r] for r in ranks])}</td>"
            f"<td>{_spread(steps, 'd')}</td><td>{_spread(losses, '.4g')}</td>"
            f"<td>{_spread(rates, ',.0f')}</td>"
            f"<td>{_spread(work, ',.0f') + ' ms' if work else ''}</td>"
            f"<td>{elapsed:.1f} s</td><td>{_eta(agg.last[behind], agg.total_steps, elapsed)}</td>"
            "</tr>"
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "host",
            "ranks",
            "state",
            "step",
            "loss",
            "samples/s",
            "work/step",
            "elapsed",
            "ETA",
        )  # fmt: skip
    )
    note = "<i>min / median / max over each host's ranks</i>"
    slow = dict(agg.stragglers())
    timed = [(w, r) for r in range(agg.world) if (w := agg.work_per_step(r)) is not None]
    slowest = sorted(timed, key=lambda wr: (-wr[0], wr[1]))[:SLOWEST_LISTED]
    if slowest:
        named = []
        for w, r in slowest:
            text = f"rank {r} ({hosts[r]}) {w * 1e3:,.0f} ms"
            if r in slow:
                text = f"<b>{text} ({slow[r]:.1f}× the others)</b>"
            named.append(text)
        note += "<br>slowest ranks (work/step): " + ", ".join(named)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>{note}"


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


# A run whose ranks can stop together at a step boundary (nbdist.engine.stopping) says so.
GRACEFUL_LABEL = "Stop after this step"
STOPPING_LABEL = "Stopping at the next step all ranks reach..."


def stop_button_html(
    interrupt_path: str | None, *, stopped: bool = False, graceful: bool = False
) -> str:
    """The Stop button: POSTs to ``interrupt_path`` (the server's kernel interrupt URL)."""
    if stopped or interrupt_path is None:
        label = "Stopped" if stopped else "Stop: use Kernel > Interrupt"
        return f'<button disabled style="{_BUTTON_STYLE};opacity:0.5">{label}</button>'
    onclick = _STOP_JS.replace("PATH", interrupt_path)
    if graceful:
        onclick = onclick.replace("'Stopping...'", f"'{STOPPING_LABEL}'")
    label = GRACEFUL_LABEL if graceful else "Stop"
    style = _BUTTON_STYLE
    return f'<button class="nbdist-stop" style="{style}" onclick="{onclick}">{label}</button>'


def stopping_html(step: str | None = None) -> str:
    """The Stop button once a graceful stop was asked for: disabled, saying what happens (and
    after which step, ``"step 57"``, once the ranks have agreed)."""
    label = STOPPING_LABEL if step is None else f"Stopping after {step}..."
    return f'<button disabled style="{_BUTTON_STYLE};opacity:0.7">{label}</button>'


class Dashboard:
    """The live widgets: a table row per rank, the figure, and a Stop button, shown in the
    panel's output (``display_id``), then updated in place."""

    def __init__(
        self,
        agg: Aggregate,
        figure: Figure,
        *,
        interrupt_path: str | None,
        show: Callable[[dict[str, Any]], None],
        hosts: Sequence[str] | None = None,
        graceful: bool = False,
    ) -> None:
        import ipywidgets as widgets

        self.agg = agg
        self.hosts = hosts
        self.figure = figure
        self.drawn = -1  # how many points the image shows
        self.interrupt_path = interrupt_path
        self.table = widgets.HTML()
        # At the picture's own size, as the final image is shown (narrower outputs scale both
        # alike): a widget image stretches to the output's width otherwise, and the final one
        # then came in smaller, its fonts too.
        self.image = widgets.Image(
            format="png", layout=widgets.Layout(width=f"{figure.width_px}px", max_width="100%")
        )
        self.stop = widgets.HTML(stop_button_html(interrupt_path, graceful=graceful))
        self.box = widgets.VBox([self.table, self.image, self.stop])
        show(
            {
                "application/vnd.jupyter.widget-view+json": {
                    "model_id": self.box.model_id,
                    "version_major": 2,
                    "version_minor": 0,
                },
                "text/plain": PANEL_TEXT,
            }
        )

    def draw(
        self,
        states: Sequence[str],
        smoothing: float,
        logy: bool | None,
        where: Mapping[int, Waiting] | None = None,
    ) -> float:
        """The table and the figure, from the same points (the figure is never behind the
        table); returns the seconds the figure took."""
        self.table.value = table_html(self.agg, states, time.time(), self.hosts, where)
        start = time.monotonic()
        self.image.value = self.figure.png(self.agg, smoothing, logy)
        self.drawn = self.agg.seen
        return time.monotonic() - start

    def close(self) -> None:
        """The widgets are done: the static figure takes their place."""
        for w in (self.table, self.image, self.stop, self.box):
            w.close()


# The earlier curves' model key after a healing (see LiveView's ``earlier_key``).
HEALED = "healed"


class LiveView:
    """What a run shows: the live panel once points have come for ``REDRAW_S`` (unless
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
        IPython's ``display`` (called with ``raw=True``, ``display_id=`` and ``update=``).
    interrupt_path : str or None
        The Jupyter server's interrupt URL for this kernel (``api/kernels/<id>/interrupt``),
        which the Stop button calls; None outside Jupyter.
    expect_metrics : bool
        Hold the panel's place at once (the cell will log), before the cell's first output,
        so the panel's place in the outputs does not depend on what arrives first.
    logy : bool or None
        The loss axis logarithmic or linear; None decides from the loss (more than two
        decades: logarithmic).
    earlier : sequence of Segment
        This session's earlier loss curves, which this cell's continues when it trains the same
        model further (see ``earlier_key``).
    earlier_key : str or None
        Which model the earlier curves trained (``Recorder.model``'s key). A cell that turns
        out to train another one (a different model object, or another framework) starts a
        curve of its own: the earlier ones are left out of its figure and step numbers.
        ``HEALED``: the session was healed since, and its models are new objects (a DDP
        wrapped again, a Keras model rebuilt) of the same state: whatever it trains continues.
    hosts : sequence of str or None
        Each rank's host, for the table grouped by host beyond ``MANY_RANKS`` ranks.
    graceful : bool
        The Stop button stops every rank at the same step boundary, the session kept (the
        backend has a board: ``nbdist.engine.stopping``).
    expected_steps : int or None
        The steps the cell's own text says its loop takes (``for step in range(N)``), for the
        ETA until a rank says otherwise (``log.expect``, Keras).
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
        logy: bool | None = None,
        earlier: Sequence[Segment] = (),
        earlier_key: str | None = None,
        hosts: Sequence[str] | None = None,
        graceful: bool = False,
        expected_steps: int | None = None,
    ) -> None:
        self.agg = Aggregate(world, earlier=list(earlier), total_steps=expected_steps)
        self.graceful = graceful  # Stop ends the run at a step boundary, the session kept
        self.earlier_key = earlier_key
        self.key: str | None = None  # the model this cell trains, once known
        self.hosts = list(hosts) if hosts is not None else None
        self.plot, self.smoothing, self.logy = plot, smoothing, logy
        self._display, self._interrupt_path = display, interrupt_path
        self.throttle = Throttle()
        self.throttle.ready()  # the first live draw comes REDRAW_S into the run
        self.figure: Figure | None = None
        self.dashboard: Dashboard | None = None
        self.display_id: str | None = None
        self.redraws = 0
        self._stopping = False
        self.stopping_step: int | None = None
        if plot and expect_metrics:
            self._show({"text/plain": PANEL_TEXT})

    def _show(self, bundle: dict[str, Any]) -> None:
        """Put ``bundle`` in the panel's place: the first time, a new output; then in place."""
        if self.display_id is None:
            self.display_id = uuid.uuid4().hex
            self._display(bundle, raw=True, display_id=self.display_id)
        else:
            self._display(bundle, raw=True, display_id=self.display_id, update=True)

    def _figure(self) -> Figure:
        if self.figure is None:
            self.figure = figure_for(self.agg.world, self.agg.earlier)
        return self.figure

    @property
    def continued(self) -> bool:
        """Whether this cell's curve continues the earlier cells' (the same model, trained
        further)."""
        return bool(self.agg.earlier)

    def trains(self, key: str) -> None:
        """The model this cell trains is ``key``: another one than the earlier cells' starts a
        curve of its own (the points taken in so far are taken in again, from step 0)."""
        if self.key is not None:
            return
        self.key = key
        if self.agg.earlier and key != self.earlier_key and self.earlier_key != HEALED:
            total, self.agg = self.agg.total_steps, Aggregate(self.agg.world, start=self.agg.start)
            self.agg.total_steps = total
            if self.figure is not None:
                self.figure.reset()
            if self.dashboard is not None:
                self.dashboard.agg = self.agg
                self.dashboard.drawn = -1

    def stopping(self, step: int | None = None) -> None:
        """A graceful stop was asked for: the Stop button says the ranks are stopping (after
        ``step``, once they have agreed on it)."""
        self._stopping = True
        self.stopping_step = step
        if self.dashboard is not None:
            self.dashboard.stop.value = stopping_html(self._stopping_text())

    def _stopping_text(self) -> str | None:
        """After which step the ranks stop (``stopping_step``: the steps they will have taken),
        numbered as the table numbers them."""
        taken = self.stopping_step
        return None if taken is None else self.agg.step_text(taken - 1)

    def update(
        self,
        history: Sequence[dict[str, Any]],
        states: Sequence[str],
        *,
        total_steps: int | None = None,
        force: bool = False,
        key: str | None = None,
        where: Mapping[int, Waiting] | None = None,
    ) -> bool:
        """Take in new points; redraw if the throttle allows. Returns whether it redrew.
        ``key``: the model the cell trains, once a rank has said (see :meth:`trains`);
        ``where``: the ranks that have not stepped for a while, and where they are."""
        if key is not None:
            self.trains(key)
        self.agg.add(history)
        if total_steps is not None:
            self.agg.total_steps = total_steps
        if not history or not self.plot or not self.throttle.ready(force):
            return False
        if self.dashboard is None:
            self.dashboard = Dashboard(
                self.agg,
                self._figure(),
                interrupt_path=self._interrupt_path,
                show=self._show,
                hosts=self.hosts,
                graceful=self.graceful,
            )
            if self._stopping:
                self.dashboard.stop.value = stopping_html(self._stopping_text())
        took = self.dashboard.draw(states, self.smoothing, self.logy, where)
        # The next update when drawing has cost no more than its share of a core (the table
        # waits with the figure: one picture of the run, never one behind the other).
        self.throttle.interval = figure_wait(took, self.agg.world)
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
        key: str | None = None,
        steps_taken: int | None = None,
    ) -> str | None:
        """The static figure in the panel's place and the summary line (returned); None
        without metrics (and the panel's place, if one was held, left empty). ``key``: the
        model the cell trained (``framework:log`` for a cell that logged without one);
        ``steps_taken``: after a graceful stop, the steps every rank took: the points of a
        step beyond them (its update not taken) are left out, though the panel showed them."""
        self.trains(key or f"{framework}:log")
        if steps_taken is not None:
            history = [h for h in history if h["step"] < steps_taken]
            agg = self.agg
            self.agg = Aggregate(
                agg.world, start=agg.start, earlier=agg.earlier, total_steps=agg.total_steps
            )
        self.agg.add(history)
        dashboard, self.dashboard = self.dashboard, None
        if dashboard is not None:
            dashboard.close()
        if not history:
            if self.display_id is not None:
                self._show({"text/plain": ""})
            return None
        if self.plot:
            # the live figure is reused when its cell ran to its end and it is up to date
            if dashboard is not None and steps_taken is None and dashboard.drawn == self.agg.seen:
                png = dashboard.image.value  # (no second render)
            else:
                png = self._figure().png(self.agg, self.smoothing, self.logy)
            self._show({"image/png": png_data(png), "text/plain": PANEL_TEXT})
        logy = self.plot and use_log_scale(self.agg, self.logy)
        return self.agg.summary(wall, framework, detail, logy=logy)
