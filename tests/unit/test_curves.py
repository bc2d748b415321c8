"""Throughput from the workers' own timestamps, loss scale, stragglers: on the figure's data."""

import random

import pytest

from nbdist.kernel.curves import TOO_SHORT, Aggregate
from nbdist.kernel.figure import Figure


def steady(world, *, seconds, batch=32, rate=1000.0, epoch_s=None, gap_s=0.0, seed=0):
    """Each rank's points at ``rate`` samples/s with jittered step times; with ``epoch_s``,
    a pause of ``gap_s`` after every epoch (Keras' epoch end), in time order."""
    rng = random.Random(seed)
    points = []
    for rank in range(world):
        t, step, epoch_end = 1000.0, 0, 1000.0 + (epoch_s or float("inf"))
        while t < 1000.0 + seconds:
            t += batch / rate * rng.uniform(0.8, 1.2)
            points.append({"rank": rank, "step": step, "time": t, "loss": 1.0, "samples": batch})
            step += 1
            if t >= epoch_end:
                t += gap_s
                epoch_end = t + epoch_s
    return sorted(points, key=lambda p: p["time"])


def bursts(points, every_s):
    """The points as the transport hands them over: all of those stamped within each
    ``every_s`` at once (a flush every 0.1 s; with Keras, a whole epoch)."""
    out, chunk, edge = [], [], points[0]["time"] + every_s
    for p in points:
        if p["time"] > edge:
            out.append(chunk)
            chunk, edge = [], edge + every_s
        chunk.append(p)
    return [*out, chunk]


def _drawn(fig):
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in fig.ax_rate.get_lines()]


@pytest.mark.parametrize(
    "epoch_s, gap_s, burst_s",
    [(None, 0.0, 0.1), (None, 0.0, 1.0), (1.0, 0.03, 1.0)],
    ids=["flushes", "one-second-bursts", "keras-epochs"],
)
def test_a_steady_stream_draws_flat_lines_however_it_arrives(epoch_s, gap_s, burst_s):
    points = steady(2, seconds=8, epoch_s=epoch_s, gap_s=gap_s)
    agg = Aggregate(2, start=1000.0)
    history = []
    fig = Figure(2)
    for chunk in bursts(points, burst_s):  # drawn after every burst, as the live panel does
        history += chunk
        agg.add(history)
        fig.draw(agg)
    (tx, total), *ranks = _drawn(fig)
    assert len(tx) >= 100 and tx[-1] > 7.5  # up to the end of the run
    assert all(abs(v - 2000) <= 200 for v in total), (min(total), max(total))
    for xs, ys in ranks:
        tail = ys[5:]  # the first few points: a window of a handful of steps
        assert len(xs) > 200 and all(abs(v - 1000) <= 100 for v in tail), (min(tail), max(tail))


def test_a_one_second_run_has_throughput_lines():
    agg = Aggregate(2, start=1000.0)
    agg.add(steady(2, seconds=1.0, batch=16, rate=800.0))
    fig = Figure(2)
    fig.draw(agg)
    for xs, ys in _drawn(fig):
        assert len(xs) >= 2 and min(ys) > 0
    assert fig.note.get_text() == ""


def test_a_run_too_short_to_measure_says_so():
    agg = Aggregate(2, start=1000.0)
    agg.add([{"rank": r, "step": 0, "time": 1000.1, "loss": 1.0, "samples": 8} for r in (0, 1)])
    fig = Figure(2)
    fig.draw(agg)
    assert fig.note.get_text() == TOO_SHORT
    assert all(xs == [] for xs, _ in _drawn(fig))


def test_two_points_per_rank_are_drawn_as_markers():
    agg = Aggregate(1, start=1000.0)
    agg.add([{"rank": 0, "step": s, "time": 1000.0 + s, "samples": 8} for s in (0, 1)])
    fig = Figure(1)
    fig.draw(agg)
    (tx, total), (rx, ry) = _drawn(fig)
    assert total == ry == [8.0] and fig.rank_lines[0].get_marker() == "o"


def _falling(decades, steps=50):
    return [
        {"rank": 0, "step": s, "time": float(s), "loss": 10 ** (-decades * s / (steps - 1))}
        for s in range(steps)
    ]


@pytest.mark.parametrize(
    "decades, logy, scale",
    [(5, None, "log"), (1.5, None, "linear"), (5, False, "linear"), (1.5, True, "log")],
)
def test_the_loss_axis_is_logarithmic_over_more_than_two_decades(decades, logy, scale):
    agg = Aggregate(1, start=0.0)
    agg.add(_falling(decades))
    fig = Figure(1)
    fig.draw(agg, logy=logy)
    assert fig.ax_loss.get_yscale() == scale


def test_the_summary_says_the_axis_is_logarithmic():
    agg = Aggregate(1, start=0.0)
    agg.add(_falling(5))
    assert "loss axis logarithmic (the loss spans 5.0 decades)" in agg.summary(
        1.0, "torch", logy=True
    )
    assert "logarithmic" not in agg.summary(1.0, "torch", logy=False)


def _working(work_s, steps=100, waits=None):
    """Ranks in step: each waits for the slowest (unless ``waits`` says otherwise)."""
    waits = waits or [max(work_s) - w for w in work_s]
    return [
        {"rank": r, "step": s, "time": float(s), "loss": 1.0, "work": w, "wait": t}
        for s in range(steps)
        for r, (w, t) in enumerate(zip(work_s, waits, strict=True))
    ]


def test_the_rank_the_others_wait_for_is_named():
    agg = Aggregate(3, start=0.0)
    agg.add(_working([0.010, 0.016, 0.0102]))  # 5.9 ms more, 100 steps: 0.59 s of waiting
    assert agg.stragglers() == [(1, pytest.approx(0.016 / 0.0101))]
    assert "rank 1 keeps the others waiting: 1.6× their working time per step" in agg.summary(
        1.0, "torch"
    )


def test_no_straggler_when_the_ranks_work_alike():
    agg = Aggregate(2, start=0.0)
    agg.add(_working([0.010, 0.012]))
    assert agg.stragglers() == []
    assert "waiting" not in agg.summary(1.0, "torch")


def test_a_fraction_of_a_millisecond_is_no_straggler():
    agg = Aggregate(2, start=0.0)
    agg.add(_working([0.0002, 0.0004]))  # twice as long, but nobody waits 0.2 ms for long
    assert agg.stragglers() == []


def test_too_few_steps_to_compare():
    agg = Aggregate(2, start=0.0)
    agg.add([p for p in _working([0.010, 0.030]) if p["step"] < 9])
    assert agg.stragglers() == [] and agg.work_per_step(1) is None


def test_a_short_cell_names_no_straggler():
    """Tutorial 01's training cell: 20 steps of ~5 ms. One rank twice as slow (a busy machine
    slowing a rank) adds up to 0.1 s of waiting: not worth naming."""
    agg = Aggregate(2, start=0.0)
    agg.add(_working([0.005, 0.010], steps=20))
    assert agg.stragglers() == []
    agg = Aggregate(2, start=0.0)
    agg.add(_working([0.005, 0.010], steps=19))  # the same over fewer steps than counted
    assert agg.stragglers() == []


def test_a_slower_rank_nobody_waits_for_is_no_straggler():
    agg = Aggregate(2, start=0.0)
    agg.add(_working([0.010, 0.040], waits=[0.0, 0.0]))  # no collective: nobody waits
    assert agg.stragglers() == []
