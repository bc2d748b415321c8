"""The engine's one thread for periodic work (metric flushes, stack samples)."""

from __future__ import annotations

import threading
import time

from nbdist.engine.ticker import Ticker


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_tasks_run_every_period_until_cancelled():
    ticker, calls = Ticker(), []
    tick = ticker.every(0.02, lambda: calls.append(time.monotonic()))
    assert _wait_for(lambda: len(calls) >= 5)
    tick.cancel()
    after = len(calls)
    time.sleep(0.1)
    assert len(calls) == after


def test_cancel_returns_once_a_running_task_has_ended():
    ticker, started, ended = Ticker(), threading.Event(), []

    def slow():
        started.set()
        time.sleep(0.2)
        ended.append(True)

    tick = ticker.every(0.01, slow)
    assert started.wait(5)
    tick.cancel()
    assert ended  # cancel waited for the running call to finish
    n = len(ended)
    time.sleep(0.05)
    assert len(ended) == n


def test_one_thread_serves_many_cells():
    """What every cell does (a flush task and a sampler started and stopped) reuses one thread,
    so no per-cell thread (and no per-thread iopub socket in ipykernel) is made."""
    ticker, threads = Ticker(), set()
    for _ in range(20):
        seen = threading.Event()
        a = ticker.every(0.005, lambda s=seen: (threads.add(threading.get_ident()), s.set()))
        b = ticker.every(0.005, lambda: threads.add(threading.get_ident()))
        assert seen.wait(5)
        a.cancel()
        b.cancel()
    assert len(threads) == 1


def test_a_failing_task_does_not_stop_the_others(capfd):
    ticker, calls = Ticker(), []
    bad = ticker.every(0.01, lambda: 1 / 0)
    good = ticker.every(0.01, lambda: calls.append(1))
    assert _wait_for(lambda: len(calls) >= 3)
    bad.cancel()
    good.cancel()
    assert "ZeroDivisionError" in capfd.readouterr().err


def test_a_task_added_while_the_ticker_sleeps_runs_at_its_own_period():
    ticker, calls = Ticker(), []
    first = ticker.every(30.0, lambda: None)  # the thread now sleeps ~30 s
    time.sleep(0.05)
    second = ticker.every(0.01, lambda: calls.append(1))
    assert _wait_for(lambda: len(calls) >= 2, timeout=2)
    first.cancel()
    second.cancel()
