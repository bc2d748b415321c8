"""The live view's pieces: downsampling, smoothing, throttling, aggregation, what gets shown."""

import base64
import json

import pytest

from nbdist.kernel import display as d
from nbdist.kernel.curves import Aggregate, Segment
from nbdist.kernel.display import PANEL_TEXT, LiveView, Throttle
from nbdist.kernel.figure import FIGURE_TEXT, downsample, ema


def test_downsample_is_bounded_and_keeps_the_ends():
    keep = downsample(list(range(100_003)), max_points=2000)
    assert len(keep) <= 2000
    assert keep[0] == 0 and keep[-1] == 100_002
    assert keep == sorted(set(keep))
    assert downsample([1, 2, 3], max_points=2000) == [0, 1, 2]


def test_ema():
    assert ema([1.0, 3.0, 3.0], 1.0) == [1.0, 3.0, 3.0]
    assert ema([1.0, 3.0, 3.0], 0.5) == [1.0, 2.0, 2.5]


def test_throttle_by_wall_clock():
    now = [0.0]
    t = Throttle(interval=0.5, clock=lambda: now[0])
    fired = []
    for i in range(100):  # 100 updates within 1 s
        now[0] = i * 0.01
        fired.append(t.ready())
    assert sum(fired) == 2  # at 0.0 and 0.5
    assert t.ready(force=True)


def _points(world=2, steps=4, dt=0.5):
    return [
        {"rank": r, "step": s, "time": 100.0 + s * dt, "loss": float(10 - s + r), "samples": 32}
        for s in range(steps)
        for r in range(world)
    ]


def test_aggregate_loss_band_and_rates():
    agg = Aggregate(2, start=100.0)
    agg.add(_points())
    steps, mean, lo, hi = agg.loss_curve()
    assert steps == [0, 1, 2, 3]
    assert mean == [10.5, 9.5, 8.5, 7.5]
    assert (lo, hi) == ([10.0, 9.0, 8.0, 7.0], [11.0, 10.0, 9.0, 8.0])
    assert agg.rate(0) == pytest.approx(3 * 32 / 1.5)  # samples after the first / span
    times, total, per_rank = agg.throughput_curve()
    assert total == pytest.approx([2 * 64.0] * len(times))
    assert per_rank[0] == ([0.5, 1.0, 1.5], [64.0, 64.0, 64.0])
    assert agg.last[1]["step"] == 3


def test_summary_line():
    agg = Aggregate(2, start=100.0)
    agg.add(_points())
    assert agg.summary(2.0, "torch") == (
        "nbdist: final loss 7.5 (step 3, mean over ranks) · 128 samples/s total, 64 per rank "
        "(256 samples) · wall 2.0 s · 2 workers (torch)"
    )


def test_a_cell_that_continues_the_session_says_both_step_counts():
    """Steps are numbered from 0 in each cell, as its loop counts them; where the curve goes on
    from earlier cells, the session's count is said beside the cell's, labelled, everywhere."""
    from nbdist.kernel.curves import Segment
    from nbdist.kernel.display import table_html
    from nbdist.kernel.failures import graceful_stop

    earlier = [Segment(steps=list(range(300)), loss=[1.0] * 300)]
    agg = Aggregate(2, start=100.0, earlier=earlier)
    agg.add(_points())
    assert agg.summary(2.0, "torch").startswith(
        "nbdist: final loss 7.5 (mean over ranks; step 3 of this cell, 303 in the session) · "
    )
    table = table_html(agg, ["running", "running"], now=101.0)
    assert "<th>step (cell / session)</th>" in table and "<td>3 / 303</td>" in table
    stop = graceful_stop({0: 4, 1: 4}, agg.step_text)
    assert str(stop).startswith(
        "stopped (Stop button or Kernel > Interrupt): every rank stopped after step 3 of this "
        "cell, 303 in the session (4 steps taken).\n"
    )
    # A first cell: one count.
    alone = Aggregate(2, start=100.0)
    alone.add(_points())
    assert "<th>step</th>" in table_html(alone, ["done", "done"], now=101.0)
    assert str(graceful_stop({0: 1, 1: 1}, alone.step_text)).startswith(
        "stopped (Stop button or Kernel > Interrupt): every rank stopped after step 0 (1 step "
        "taken).\n"
    )


def test_after_a_graceful_stop_the_step_it_interrupted_is_left_out():
    """Stopped after 3 steps taken: the panel had shown step 3's loss (computed, its update not
    taken); the final figure and the summary end at step 2, as the Stop message says."""
    spy = SpyDisplay()
    live = LiveView(2, plot=True, smoothing=1.0, display=spy)
    live.throttle = Throttle(interval=0.5, clock=lambda: 1.0)
    history = _points(steps=4)
    live.update(history, ["running", "running"], force=True)
    assert "<td>3</td>" in live.dashboard.table.value
    summary = live.finish(
        history, ["stopped", "stopped"], wall=1.0, framework="torch", steps_taken=3
    )
    assert summary.startswith("nbdist: final loss 8.5 (step 2, mean over ranks)")
    assert live.agg.loss_curve()[0] == [0, 1, 2]


def test_losses_read_alike_in_a_column_and_never_as_minus_zero():
    from nbdist.kernel.curves import losses_text, number

    assert losses_text([0.008133, 0.01014]) == ["0.00813", "0.01014"]
    assert losses_text([2.5, None, 12.25]) == ["2.50", "", "12.25"]
    assert losses_text([4.29e-06, 4.866e-06]) == ["4.290e-06", "4.866e-06"]
    assert number(-0.0) == "0" and number(0.12345) == "0.1235"


class SpyDisplay:
    """Records what is shown, as a frontend would hold it: one output per display id."""

    def __init__(self):
        self.calls = []
        self.outputs = {}  # display id -> the bundle it shows now

    def __call__(self, obj, raw=False, display_id=None, update=False):
        assert raw
        self.calls.append((obj, display_id, update))
        if update:
            assert display_id in self.outputs, "an update of an output never shown"
        self.outputs[display_id] = obj

    @property
    def shown(self):
        return list(self.outputs.values())


def test_no_metrics_no_panel_no_summary():
    spy = SpyDisplay()
    live = LiveView(2, plot=True, smoothing=1.0, display=spy)
    live.update([], ["running", "running"])
    assert live.finish([], ["done", "done"], wall=1.0, framework="torch") is None
    assert spy.calls == []


def test_a_held_place_left_empty_when_no_metric_came():
    spy = SpyDisplay()
    live = LiveView(2, plot=True, smoothing=1.0, display=spy, expect_metrics=True)
    assert spy.shown == [{"text/plain": PANEL_TEXT}]
    assert live.finish([], ["done", "done"], wall=1.0, framework="torch") is None
    assert spy.shown == [{"text/plain": ""}]


def test_panel_in_place_then_the_static_figure_in_the_same_place():
    spy = SpyDisplay()
    path = "api/kernels/0f1e/interrupt"
    live = LiveView(
        2, plot=True, smoothing=1.0, display=spy, interrupt_path=path, expect_metrics=True
    )
    assert spy.shown == [{"text/plain": PANEL_TEXT}]  # the place, held: no widget yet
    now = [42.0]
    live.throttle = Throttle(interval=0.5, clock=lambda: now[0])
    history = []
    for p in _points(steps=50):
        history.append(p)
        live.update(history, ["running", "running"], total_steps=100)
    assert live.redraws == 1  # all updates within one instant: the throttle holds the rest back
    (panel,) = spy.shown
    assert "application/vnd.jupyter.widget-view+json" in panel
    assert "<td>running</td>" in live.dashboard.table.value
    stop = live.dashboard.stop.value
    assert stop.startswith('<button class="nbdist-stop"') and ">Stop</button>" in stop
    assert "+'api/kernels/0f1e/interrupt',{method:'POST'" in stop
    widgets = live.dashboard.box
    summary = live.finish(history, ["done", "done"], wall=3.0, framework="torch")
    assert summary.startswith("nbdist: final loss")
    # nbval reads no display updates: every state of the place has the same text/plain
    assert {bundle["text/plain"] for bundle, _, _ in spy.calls} == {PANEL_TEXT}
    (final,) = spy.shown  # one output, all along: the figure took the widgets' place
    assert _png(final).startswith(b"\x89PNG") and final["text/plain"] == FIGURE_TEXT
    assert len({display_id for _, display_id, _ in spy.calls}) == 1
    assert widgets.comm is None  # closed: nothing left to show a second figure
    assert live.dashboard is None


def test_a_short_run_builds_no_widgets_and_renders_once(monkeypatch):
    renders = []
    real_png = d.Figure.png
    monkeypatch.setattr(d.Figure, "png", lambda self, *a: renders.append(1) or real_png(self, *a))
    spy = SpyDisplay()
    live = LiveView(2, plot=True, smoothing=1.0, display=spy, expect_metrics=True)
    history = _points(steps=20, dt=0.01)
    live.update(history, ["running", "running"])  # within REDRAW_S of the start
    assert live.dashboard is None and live.redraws == 0
    assert live.finish(history, ["done", "done"], wall=0.2, framework="torch")
    assert renders == [1]
    (final,) = spy.shown
    assert _png(final).startswith(b"\x89PNG")


def test_the_live_figure_is_reused_when_nothing_came_after_it(monkeypatch):
    spy = SpyDisplay()
    live = LiveView(2, plot=True, smoothing=1.0, display=spy)
    live.throttle = Throttle(interval=0.5, clock=lambda: 1.0)
    history = _points(steps=10)
    live.update(history, ["running", "running"], force=True)
    image = live.dashboard.image.value
    monkeypatch.setattr(d.Figure, "png", lambda *a: pytest.fail("rendered twice"))
    live.finish(history, ["done", "done"], wall=3.0, framework="torch")
    assert _png(spy.shown[-1]) == image


def test_the_final_figure_is_valid_png_when_the_widget_holds_a_memoryview(monkeypatch):
    """ipywidgets may give the live image back as a memoryview: sent as it was, it became a
    JSON list of numbers (a broken image, and a notebook that failed validation on save)."""
    import nbformat

    spy = SpyDisplay()
    live = LiveView(2, plot=True, smoothing=1.0, display=spy)
    live.throttle = Throttle(interval=0.5, clock=lambda: 1.0)
    history = _points(steps=10)
    live.update(history, ["running", "running"], force=True)
    image = live.dashboard.image.value
    live.dashboard.image.value = memoryview(bytes(image))
    assert isinstance(live.dashboard.image.value, memoryview)
    live.finish(history, ["done", "done"], wall=3.0, framework="torch")
    bundle = spy.shown[-1]
    assert isinstance(bundle["image/png"], str) and _png(bundle) == bytes(image)
    output = nbformat.v4.new_output("display_data", data=bundle)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=[output])])
    nbformat.validate(nbformat.from_dict(json.loads(nbformat.writes(nb))))


def _png(bundle) -> bytes:
    return base64.b64decode(bundle["image/png"])


MODEL = "torch:4242:7f00aa"  # Recorder.model's key: a DDP model object on an engine


def test_earlier_cells_continue_the_curve():
    spy = SpyDisplay()
    earlier = [Segment([0, 1, 2], [3.0, 2.0, 1.5]), Segment([3, 4], [1.2, 1.0])]
    live = LiveView(2, plot=True, smoothing=1.0, display=spy, earlier=earlier, earlier_key=MODEL)
    history = _points(steps=4)  # this cell counts its steps from 0 again
    live.finish(history, ["done", "done"], wall=2.0, framework="torch", key=MODEL)
    assert live.continued
    assert live.agg.loss_curve()[0] == [5, 6, 7, 8]
    assert live.agg.segment().steps == [5, 6, 7, 8]
    faint, current = live.figure.ax_loss.get_lines()
    assert live.figure.ax_loss.get_title().endswith("; pale: earlier cells")
    assert faint.get_label() == "earlier cells"
    assert faint.get_alpha() == 0.35 and current.get_alpha() is None  # fainter: drawn opaque
    xs = [x for x in faint.get_xdata() if x == x]  # without the breaks between cells
    assert xs == [0, 1, 2, 3, 4]
    assert list(current.get_xdata()) == [5, 6, 7, 8]


@pytest.mark.parametrize(
    "key",
    ["torch:4242:7f00bb", "keras:4242:7f00aa", None],
    ids=["another-model", "another-framework", "no-model"],
)
def test_a_cell_that_trains_another_model_starts_a_curve_of_its_own(key):
    spy = SpyDisplay()
    earlier = [Segment([0, 1, 2], [300.0, 200.0, 150.0])]
    live = LiveView(2, plot=True, smoothing=1.0, display=spy, earlier=earlier, earlier_key=MODEL)
    live.throttle = Throttle(interval=0.5, clock=lambda: 1.0)
    history = _points(steps=4)
    # Drawn live as a continuation first: the model's key comes with a later message.
    live.update(history[:4], ["running"] * 2, force=True)
    assert live.agg.loss_curve()[0] == [3, 4]
    live.update(history, ["running"] * 2, force=True, key=key)
    summary = live.finish(history, ["done", "done"], wall=2.0, framework="torch", key=key)
    assert not live.continued
    assert live.agg.loss_curve()[0] == [0, 1, 2, 3]
    assert live.figure.ax_loss.get_title() == "loss (mean over ranks, min–max band)"
    faint, current = live.figure.ax_loss.get_lines()
    assert list(faint.get_xdata()) == [] and list(current.get_xdata()) == [0, 1, 2, 3]
    assert "logarithmic" not in summary  # the earlier model's losses no longer count


def test_steps_that_already_continue_the_session_stay_as_they_are():
    agg = Aggregate(1, earlier=[Segment(list(range(100)), [1.0] * 100)])
    agg.add([{"rank": 0, "step": 120 + s, "time": float(s), "loss": 1.0} for s in range(3)])
    assert agg.loss_curve()[0] == [120, 121, 122]


def test_no_plot_gives_the_summary_only():
    spy = SpyDisplay()
    live = LiveView(2, plot=False, smoothing=1.0, display=spy)
    history = _points()
    live.update(history, ["running"] * 2)
    assert live.finish(history, ["done"] * 2, wall=2.0, framework="torch").startswith("nbdist:")
    assert spy.shown == []


def test_eta_from_total_steps():
    agg = Aggregate(1, start=0.0)
    agg.add([{"rank": 0, "step": 9, "time": 1.0, "loss": 1.0}])
    agg.total_steps = 100
    html = d.table_html(agg, ["running"], now=10.0)
    assert "<td>90 s</td>" in html  # 10 steps took 10 s: 90 more steps to go


def test_outside_jupyter_the_stop_button_points_to_the_interrupt():
    assert ">Stop: use Kernel > Interrupt</button>" in d.stop_button_html(None)


def test_earlier_cells_count_for_the_log_scale():
    spy = SpyDisplay()
    earlier = [Segment([0, 1, 2], [100.0, 10.0, 1.0])]
    live = LiveView(2, plot=True, smoothing=1.0, display=spy, earlier=earlier, earlier_key=MODEL)
    history = [
        {"rank": r, "step": s, "time": float(s), "loss": 0.5} for s in range(3) for r in (0, 1)
    ]
    summary = live.finish(history, ["done", "done"], wall=2.0, framework="torch", key=MODEL)
    assert live.figure.ax_loss.get_yscale() == "log"
    assert "loss axis logarithmic (the loss spans 2.3 decades)" in summary


def test_the_live_figure_is_redrawn_within_its_budget_and_its_age_limit():
    from nbdist.kernel.display import figure_wait

    assert figure_wait(0.001, 2) == 0.5  # cheap draws: every REDRAW_S, no more often
    assert figure_wait(0.05, 2) == 1.0  # 5% of a core
    assert figure_wait(0.2, 2) == 2.0  # slow draws: never older than 2 s
    assert figure_wait(0.2, 17) == 0.5  # min-max bands past 16 ranks: with the table
    assert figure_wait(0.001, 512) == 0.5


def test_the_figure_keeps_up_with_the_table_at_the_final_pictures_size():
    """Every redraw draws the table and the figure from the same points, the next one as far
    off as the figure's cost allows; the live image is shown at the picture's own size."""
    spy = SpyDisplay()
    live = LiveView(2, plot=True, smoothing=1.0, display=spy)
    now = [10.0]
    live.throttle = Throttle(interval=0.5, clock=lambda: now[0])
    history = []
    for step, point in enumerate(_points(steps=40)):
        history.append(point)
        now[0] += 0.05
        if live.update(history, ["running", "running"]):
            assert live.dashboard.drawn == live.agg.seen == len(history)
            last = max(p["step"] for p in history)
            assert f"<td>{last}</td>" in live.dashboard.table.value, step
    assert live.redraws >= 2
    assert 0.5 <= live.throttle.interval <= 2.0
    layout = live.dashboard.image.layout
    assert (layout.width, layout.max_width) == (f"{live.figure.width_px}px", "100%")
    assert live.figure.width_px == 864


def test_the_stop_button_says_what_a_graceful_stop_does():
    from nbdist.kernel.display import stop_button_html, stopping_html

    button = stop_button_html("api/kernels/k/interrupt", graceful=True)
    assert ">Stop after this step</button>" in button
    assert "'Stopping at the next step all ranks reach...'" in button  # on click
    assert ">Stop</button>" in stop_button_html("api/kernels/k/interrupt")
    assert ">Stopping after step 7...</button>" in stopping_html("step 7")
