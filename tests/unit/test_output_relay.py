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


class ClientText(SimpleNamespace):
    """A task's stdout/stderr as ipyparallel's client builds them from stream messages: each
    chunk appended, and a line rewritten after a carriage return folded into its last version
    (``Client._dispatch_iopub``, with the client's own pattern)."""

    def write(self, name, chunk):
        from ipyparallel.client.client import _cr_pat

        text = getattr(self, name) + chunk
        if "\r" in chunk:
            text = _cr_pat.sub("", text)
        setattr(self, name, text)


def _task():
    return ClientText(stdout="", stderr="")


class SpyDisplay:
    def __init__(self):
        self.calls = []

    def __call__(self, bundle, raw, display_id, update=False):
        self.calls.append((dict(bundle), display_id, update))


def test_a_keras_progress_bar_ends_on_its_last_line_and_shows_while_it_runs(monkeypatch):
    """Keras' Progbar in a kernel: backspaces over the previous line, a carriage return, the
    new line; a newline after the epoch's last one."""
    clock = [0.0]
    monkeypatch.setattr(relay_module.time, "monotonic", lambda: clock[0])
    out, spy = io.StringIO(), SpyDisplay()
    relay = OutputRelay([True], out, io.StringIO(), display=spy)
    task = _task()
    task.write("stdout", "Epoch 1/2\n")
    previous = ""
    for step in (1, 2, 16, 32):
        line = f"{step:>2}/32 {'━' * step} {40 - step}s - loss: {10 / step:.4f}"
        line += " " * max(0, len(previous) - len(line))  # Keras pads to the previous width
        task.write("stdout", "\b" * len(previous) + "\r" + line)
        previous = line
        clock[0] += 0.5
        relay.pump([task])
        if step == 2:
            (bundle, _, _) = spy.calls[-1]
            assert bundle["text/plain"] == f"[rank 0] {line}"  # the bar as it is now
    task.write("stdout", "\n")
    clock[0] += 0.5
    relay.pump([task], final=True)
    assert out.getvalue() == f"[rank 0] Epoch 1/2\n[rank 0] {previous}\n"
    assert spy.calls[-1][0] == {"text/plain": ""}  # emptied: the line is in the cell's text
    assert len({display_id for _, display_id, _ in spy.calls}) == 1  # one place, updated


def test_a_line_finished_at_once_never_shows_as_progress():
    spy = SpyDisplay()
    relay = OutputRelay([True], io.StringIO(), io.StringIO(), display=spy)
    task = _task()
    task.write("stdout", "hello\n")
    relay.pump([task], final=True)
    assert spy.calls == []


def test_the_same_warning_from_every_rank_is_written_once_with_the_ranks(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(relay_module.time, "monotonic", lambda: clock[0])
    err = io.StringIO()
    relay = OutputRelay([True, True], io.StringIO(), err)
    warning = "/x/dataloader.py:759: UserWarning: 'pin_memory' argument is set as true\n"
    a, b = _task(), _task()
    a.write("stderr", warning + "  super().__init__(loader)\n")
    relay.pump([a, b])
    assert err.getvalue() == ""  # waiting for rank 1's copy
    clock[0] += 0.2
    b.write("stderr", warning + "  super().__init__(loader)\n")
    relay.pump([a, b])
    assert err.getvalue() == (
        "[ranks 0,1] /x/dataloader.py:759: UserWarning: 'pin_memory' argument is set as true\n"
        "[ranks 0,1]   super().__init__(loader)\n"
    )
    # Values that differ in a memory address only are the same line; a line of one rank goes
    # out once it has waited MERGE_S for the others.
    a.write("stderr", "<History object at 0x7fcf0001>\nonly on rank 0\n")
    b.write("stderr", "<History object at 0x7fcf0abc>\n")
    relay.pump([a, b])
    clock[0] += OutputRelay.MERGE_S
    relay.pump([a, b])
    assert err.getvalue().splitlines()[2:] == [
        "[ranks 0,1] <History object at 0x7fcf0001>",
        "[rank 0] only on rank 0",
    ]


def test_ranks_labels():
    from nbdist.kernel.relay import ranks_label

    assert ranks_label([3]) == "[rank 3]"
    assert ranks_label([1, 0]) == "[ranks 0,1]"
    assert ranks_label([0, 1, 2, 3, 7, 9, 10]) == "[ranks 0-3,7,9,10]"


def test_a_finished_line_the_client_folds_later_is_not_read_again():
    """A carriage return at the end of one message, the line that overwrites it in the next
    (no carriage return in it: nothing folded yet), a newline: then a later message with a
    carriage return folds that finished line, and everything after it moves."""
    out = io.StringIO()
    relay = OutputRelay([True], out, io.StringIO())
    task = _task()
    for chunk in [
        "Epoch 1/2\n",
        " 8/32 ━━ - loss: 5.0000\b\b\b\r",
        "32/32 ━━━━━━━━ - loss: 1.2000\n",
        "Epoch 2/2\n",
    ]:
        task.write("stdout", chunk)
        relay.pump([task])
    # One message folds line 2 (26 characters shorter) and finishes a line: read by offset,
    # the new line came out as "00".
    task.write("stdout", " 1/32 ━ - loss: 1.1000\b\b\r32/32 ━━━━━━━━ - loss: 0.9000\n")
    relay.pump([task], final=True)
    assert out.getvalue().splitlines() == [
        "[rank 0] Epoch 1/2",
        "[rank 0] 32/32 ━━━━━━━━ - loss: 1.2000",
        "[rank 0] Epoch 2/2",
        "[rank 0] 32/32 ━━━━━━━━ - loss: 0.9000",
    ]
