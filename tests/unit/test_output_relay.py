"""The relay that forwards the ranks' printed lines into the cell."""

import io
from types import SimpleNamespace

from nbdist.kernel import relay as relay_module
from nbdist.kernel.relay import OutputRelay


def _ars(*stdouts):
    return [SimpleNamespace(stdout=s, stderr="") for s in stdouts]


def test_a_burst_is_written_in_rank_order(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(relay_module.time, "monotonic", lambda: clock[0])
    out, err = io.StringIO(), io.StringIO()
    relay = OutputRelay([True, True], out, err)
    relay.pump(_ars("", "b1\n"))  # rank 1's line arrives first...
    clock[0] += 0.1
    relay.pump(_ars("a1\na2\n", "b1\n"))  # ...rank 0's two lines a moment later
    assert out.getvalue() == ""  # held
    clock[0] += OutputRelay.HOLD_S
    relay.pump(_ars("a1\na2\n", "b1\n"))
    assert out.getvalue() == "[rank 0] a1\n[rank 0] a2\n[rank 1] b1\n"


def test_lines_are_not_held_longer_than_the_hold_time(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(relay_module.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    relay = OutputRelay([True, True], out, io.StringIO())
    relay.pump(_ars("x\n", ""))
    clock[0] = 1.0
    relay.pump(_ars("x\n", "y\n"))  # rank 0's held line is overdue: the burst goes out now
    assert out.getvalue() == "[rank 0] x\n[rank 1] y\n"
    relay.pump(_ars("x\nz\n", "y\n"))
    assert out.getvalue() == "[rank 0] x\n[rank 1] y\n"
    relay.pump(_ars("x\nz\n", "y\n"), final=True)
    assert out.getvalue() == "[rank 0] x\n[rank 1] y\n[rank 0] z\n"


def test_partial_lines_wait_for_their_newline_or_the_end():
    out = io.StringIO()
    relay = OutputRelay([True], out, io.StringIO())
    relay.pump(_ars("no newline yet"))
    relay.pump(_ars("no newline yet"), final=True)
    assert out.getvalue() == "[rank 0] no newline yet\n"


def test_hidden_ranks_and_stderr():
    out, err = io.StringIO(), io.StringIO()
    relay = OutputRelay([False, True], out, err)
    ars = [SimpleNamespace(stdout="a\n", stderr=""), SimpleNamespace(stdout="b\n", stderr="oops\n")]
    relay.pump(ars, final=True)
    assert (out.getvalue(), err.getvalue()) == ("[rank 1] b\n", "[rank 1] oops\n")


def test_framework_log_noise_is_left_out():
    from nbdist.engine.backends.tf_mwms import OUTPUT_NOISE

    out, err = io.StringIO(), io.StringIO()
    relay = OutputRelay([True], out, err, noise=OUTPUT_NOISE)
    info = "I0000 00:00:1796295494.300853    9290 coordination_service.cc:221] Initializing\n"
    warn = "W0000 00:00:1796295495.144248    9290 dataset.cc:997] Input of GeneratorDatasetOp\n"
    info += (
        "I0000 00:00:1796296390.521591    4993 coordination_service.cc:505] Example stragglers:\n"
    )
    info += "/job:worker/replica:0/task:0\n"
    error = "E0000 00:00:1796295495.144248    9290 collective_ops.cc:12] peer lost\n"
    relay.pump(
        [SimpleNamespace(stdout="", stderr=info + warn + error + "Traceback: mine\n")], final=True
    )
    assert err.getvalue() == (
        "[rank 0] E0000 00:00:1796295495.144248    9290 collective_ops.cc:12] peer lost\n"
        "[rank 0] Traceback: mine\n"
    )
