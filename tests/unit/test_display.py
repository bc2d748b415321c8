"""The live view's pieces: downsampling, smoothing, throttling, aggregation, what gets shown."""

import pytest

from nbdist.kernel import display as d
from nbdist.kernel.display import PANEL_TEXT, Aggregate, LiveView, Throttle, downsample, ema


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
    centres, total, per_rank = agg.throughput_curve()
    assert len(centres) == len(total) == len(per_rank[0])
    assert sum(total) * 0.25 == pytest.approx(2 * 3 * 32)  # bins of 0.25 s hold every sample
    assert agg.last[1]["step"] == 3


def test_summary_line():
    agg = Aggregate(2, start=100.0)
    agg.add(_points())
    assert agg.summary(2.0, "torch") == (
        "nbdist: final loss 7.5 (step 3, mean over ranks) · 128 samples/s total, 64 per rank "
        "(256 samples) · wall 2.0 s · 2 workers (torch)"
    )


class SpyDisplay:
    def __init__(self):
        self.shown = []

    def __call__(self, obj, raw=False):
        self.shown.append(obj)


def test_no_metrics_no_panel_no_summary():
    spy = SpyDisplay()
    live = LiveView(2, plot=True, smoothing=1.0, display=spy)
    live.update([], ["running", "running"])
    assert live.finish([], ["done", "done"], wall=1.0, framework="torch") is None
    assert spy.shown == []


def test_panel_once_then_in_place_then_static_figure(monkeypatch):
    spy = SpyDisplay()
    path = "api/kernels/0f1e/interrupt"
    live = LiveView(2, plot=True, smoothing=1.0, display=spy, interrupt_path=path)
    live.throttle = Throttle(interval=0.5, clock=lambda: 42.0)  # all updates within one instant
    history = []
    for p in _points(steps=50):
        history.append(p)
        live.update(history, ["running", "running"], total_steps=100)
    assert live.redraws == 1  # one redraw: the throttle holds the rest back
    assert [o["text/plain"] for o in spy.shown] == [PANEL_TEXT]
    assert "<td>running</td>" in live.dashboard.table.value
    stop = live.dashboard.stop.value
    assert stop.startswith('<button class="nbdist-stop"') and ">Stop</button>" in stop
    assert "+'api/kernels/0f1e/interrupt',{method:'POST'" in stop
    summary = live.finish(history, ["done", "done"], wall=3.0, framework="torch")
    assert summary.startswith("nbdist: final loss")
    assert spy.shown[-1]["image/png"].startswith(b"\x89PNG")
    assert live.dashboard.image.value == spy.shown[-1]["image/png"]
    assert live.dashboard.stop.value.startswith("<button disabled")
    assert ">Stopped</button>" in live.dashboard.stop.value


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
