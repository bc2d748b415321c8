"""The cost of a short cell, counted in messages, never timed (timings live in
``benchmarks/session_cell.py``): a trivial warm cell sends one task to each rank, the one that
runs it, and no other request to the engines (a check, a poll, a memory read per rank would each
be one more round trip on every cell)."""

from __future__ import annotations

import contextlib
import io

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.torch]


def test_a_trivial_warm_cell_sends_one_task_per_rank_and_nothing_else(shell, magics):
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink):
        shell.run_cell_magic("distrain", "-n 2 --framework torch", "pass\n")
        for _ in range(2):  # warm: the group set up, the framework imported
            shell.run_cell_magic("distrain", "", "print(rank)\n")
        client = magics.cluster._client
        before = len(client.history)
        shell.run_cell_magic("distrain", "", "print(rank)\n")
        sent = client.history[before:]
    assert sink.getvalue().endswith("[rank 0] 0\n[rank 1] 1\n"), sink.getvalue()
    assert len(sent) == 2, [client.metadata.get(m) for m in sent]
    phases = magics.session.phases.times
    assert list(phases) == [
        "options", "plan", "checker", "memory", "submit", "watch", "settle", "engine", "result"
    ]  # fmt: skip
