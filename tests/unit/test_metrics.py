"""The metrics transport: batching on the engine, ordered and gap-checked reading in the kernel."""

import pytest

from nbdist.engine import metrics
from nbdist.engine.metrics import Recorder
from nbdist.kernel.metrics import MetricsStream


class Spy:
    """Stands where ipyparallel's client-side ``ar.data`` dict does: publish merges into it."""

    def __init__(self):
        self.data = {}
        self.messages = []

    def __call__(self, message):
        self.messages.append(message)
        self.data.update(message)


def test_every_point_arrives_in_order_and_the_dict_is_emptied(monkeypatch):
    monkeypatch.setattr(metrics, "MAX_BATCH", 7)
    monkeypatch.setattr(metrics, "FLUSH_S", 3600)
    spy = Spy()
    rec = Recorder(spy)
    stream = MetricsStream(world=1)
    for i in range(50):
        rec.log(loss=float(i))
        if i % 10 == 0:
            stream.pump(0, spy.data)
    rec.flush()
    stream.pump(0, spy.data)
    assert [p["step"] for p in stream.history] == list(range(50))
    assert [p["loss"] for p in stream.history] == [float(i) for i in range(50)]
    assert spy.data == {}
    assert rec.messages == 8  # seven full batches of 7, one of 1
    assert stream.complete([8]) and stream.gaps == []


def test_batches_by_time(monkeypatch):
    clock = iter([0.0, 0.05, 0.2, 0.21, 0.5])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    spy = Spy()
    rec = Recorder(spy)  # created at t=0
    rec.log(loss=1.0)  # t=0.05: wait
    rec.log(loss=2.0)  # t=0.2: flush both
    assert [len(next(iter(m.values()))) for m in spy.messages] == [2]


def test_gap_is_recorded():
    stream = MetricsStream(world=2)
    stream.pump(1, {"nbdist-00000000": [(0, 1.0, {"loss": 1.0})]})
    stream.pump(1, {"nbdist-00000002": [(5, 2.0, {"loss": 0.5})]})
    assert stream.gaps == [(1, 1)]
    assert [(p["rank"], p["step"]) for p in stream.history] == [(1, 0), (1, 5)]
    assert not stream.complete([0, 4]) and stream.complete([0, 3])


def test_explicit_log_turns_that_autocapture_off():
    spy = Spy()
    rec = Recorder(spy)
    rec.pend(samples=32)
    rec.auto(loss=3.0)
    rec.log(loss=2.5)
    rec.pend(samples=32)
    rec.auto(loss=9.0)  # dropped: the cell logs loss itself
    rec.log(loss=2.0)
    rec.flush()
    (points,) = [p for m in spy.messages for p in m.values()]
    assert [m for _, _, m in points] == [
        {"samples": 32, "loss": 3.0},
        {"loss": 2.5},
        {"samples": 32, "loss": 2.0},
    ]


def test_no_autolog_records_only_explicit_calls():
    spy = Spy()
    rec = Recorder(spy, autolog=False)
    rec.pend(samples=32)
    rec.auto(loss=1.0)
    rec.log(acc=0.5, step=10)
    rec.flush()
    (points,) = [p for m in spy.messages for p in m.values()]
    assert [(s, m) for s, _, m in points] == [(10, {"acc": 0.5})]


def test_tensors_become_floats_at_flush():
    class Scalar:
        def item(self):
            return 0.25

    spy = Spy()
    rec = Recorder(spy)
    rec.log(loss=Scalar())
    rec.flush()
    (points,) = [p for m in spy.messages for p in m.values()]
    assert points[0][2] == {"loss": 0.25}


def test_log_outside_a_cell_says_so():
    with pytest.raises(RuntimeError, match="records metrics from inside a %%distrain cell"):
        metrics.log(loss=1.0)


@pytest.mark.parametrize(("name", "instead"), [("time", "time_s"), ("rank", "worker_rank")])
def test_a_metric_named_like_a_points_own_field_is_refused(name, instead):
    spy, stream = Spy(), MetricsStream(world=1)
    rec = Recorder(spy)
    with pytest.raises(ValueError) as info:
        rec.log(**{name: 1.0, "loss": 2.0})
    assert str(info.value).startswith(f"log({name}=...): every point has its own '{name}' (")
    assert str(info.value).endswith(f"Log it under another name: log({instead}=...)")
    rec.log(step=7, loss=2.0)  # step is log's own parameter: it sets the point's step
    rec.log(**{instead: 1.0})
    rec.flush()
    stream.pump(0, spy.data)
    assert [(p["rank"], p["step"], p.get("loss"), p.get(instead)) for p in stream.history] == [
        (0, 7, 2.0, None),
        (0, 8, None, 1.0),
    ]
