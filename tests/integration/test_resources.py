"""Soak and security: no growth over many runs, nothing listening beyond loopback."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import psutil
import pytest

from nbdist import WorkerError

pytestmark = [pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

OK_CELL = textwrap.dedent(
    """
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    """
)
FAIL_CELL = OK_CELL.replace(
    "opt.step()", "opt.step()\n    if rank == 1 and step == 5:\n        raise ValueError('soak')"
)
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _tree() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _listening() -> list[tuple[int, str, int]]:
    out = []
    for proc in _tree():
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        out += [
            (proc.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN
        ]
    return sorted(out)


def _snapshot(magics) -> dict[str, float]:
    engines = [psutil.Process(e.pid) for e in magics.cluster.engines]
    return {
        "processes": len(_tree()),
        "listening_ports": len(_listening()),
        "engine_open_files": sum(p.num_fds() for p in engines),
        "engine_rss_mb": round(sum(p.memory_info().rss for p in engines) / 2**20, 1),
    }


def _run(shell, i: int) -> None:
    if i % 3 == 2:
        with pytest.raises(WorkerError, match="soak"):
            shell.run_cell_magic("distrain", "--no-plot", FAIL_CELL)
    else:
        shell.run_cell_magic("distrain", "--no-plot", OK_CELL)


@pytest.fixture(scope="module")
def warm(shell):
    shell.run_line_magic("distrain", "start -n 2")
    for i in range(6):  # reach steady state: imports, first groups, allocator pools
        _run(shell, i)
    return shell


def test_soak_25_runs_no_growth(warm, magics):
    before, ports_before = _snapshot(magics), _listening()
    for i in range(25):
        _run(warm, i)
    after, ports_after = _snapshot(magics), _listening()
    record = {
        "runs": 25,
        "failures": sum(i % 3 == 2 for i in range(25)),
        "before": before,
        "after": after,
        "ports_opened": sorted(set(ports_after) - set(ports_before)),
        "ports_closed": sorted(set(ports_before) - set(ports_after)),
    }
    out = Path(__file__).parents[2] / "build" / "soak.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    failures = record["failures"]
    assert after["processes"] == before["processes"]
    assert record["ports_closed"] == []
    # Known leak, bounded: a gloo group destroyed after a failed collective sometimes keeps its
    # loopback listener (and a few descriptors) open; successful runs open nothing.
    assert all(ip in LOOPBACK for _, ip, _ in record["ports_opened"])
    assert after["listening_ports"] - before["listening_ports"] <= failures
    assert after["engine_open_files"] - before["engine_open_files"] <= 4 * failures
    assert after["engine_rss_mb"] <= before["engine_rss_mb"] * 1.10 + 30


def test_successful_runs_open_nothing(warm, magics):
    # One-time lazy opens (libraries, caches, thread pools' eventfds) happen in the first runs:
    # measured here, +2 eventfds per engine within ~10 runs after three warm-ups, still +2
    # after 30 more. A leak grows with every run.
    for _ in range(12):
        warm.run_cell_magic("distrain", "--no-plot", OK_CELL)
    before, ports_before = _snapshot(magics), _listening()
    for _ in range(10):
        warm.run_cell_magic("distrain", "--no-plot", OK_CELL)
    after, ports_after = _snapshot(magics), _listening()
    assert ports_after == ports_before
    # A leak grows with every run (10 runs: 10+ descriptors); allow a couple of stragglers.
    assert after["engine_open_files"] <= before["engine_open_files"] + 2


def test_everything_listens_on_loopback_only(warm):
    listening = _listening()
    assert listening, "expected the controller and engines to listen somewhere"
    exposed = [item for item in listening if item[1] not in LOOPBACK]
    assert exposed == []
