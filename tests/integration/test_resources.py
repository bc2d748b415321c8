"""Soak and security: no growth over many runs, nothing listening beyond loopback."""

from __future__ import annotations

import json
import os
import socket
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


def _address(hex_addr: str) -> str:
    """An address from /proc/net/tcp{,6}: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _listening_of(pid: int) -> list[tuple[int, str, int]]:
    """TCP sockets process ``pid`` listens on, read from *its* network namespace's tables (psutil
    reads the caller's, which does not show the engines' private namespace)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    host, port = fields[1].split(":")
                    out.append((pid, _address(host), int(port, 16)))
    return out


def _listening() -> list[tuple[int, str, int]]:
    out = []
    for proc in _tree():
        try:
            out += _listening_of(proc.pid)
        except OSError:  # gone meanwhile
            continue
    return sorted(set(out))


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
    # Fresh engines: what earlier tests left on them (a TensorFlow server, which listens on
    # every address of the workers' private network) is not this module's to measure.
    shell.run_line_magic("distrain", "restart -n 2")
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
    # (Found by this test: a thread started per cell that publishes gets its own iopub socket
    # from ipykernel, closed only every 10 s: +17 here within 10 runs. Hence engine/ticker.py.)
    assert after["engine_open_files"] <= before["engine_open_files"] + 2


def test_everything_listens_on_loopback_only(warm, magics):
    """The controller listens on no TCP port at all (ipc sockets in a 0700 folder); the engines
    (gloo, the TCPStore) on loopback only, and that loopback is their private namespace's."""
    listening = _listening()
    engines = {e.pid for e in magics.cluster.engines}
    others = {pid for pid, _, _ in listening} - engines - _engine_children(engines)
    assert not others, [
        (pid, _cmdline(pid), ip, port) for pid, ip, port in listening if pid in others
    ]
    assert {pid for pid, _, _ in listening} & engines, "expected the engines to listen"
    exposed = [item for item in listening if item[1] not in LOOPBACK]
    assert exposed == []
    mine = os.readlink("/proc/self/ns/net")
    assert {os.readlink(f"/proc/{pid}/ns/net") for pid, _, _ in listening} - {mine} == {
        os.readlink(f"/proc/{magics.cluster.network.holder.pid}/ns/net")
    }


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error as e:
        return repr(e)


def _engine_children(engines: set[int]) -> set[int]:
    """Processes an engine started (ipyparallel's nanny listens on loopback for it)."""
    out = set()
    for pid in engines:
        out |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
    return out


def test_controller_sockets_are_private(warm, magics):
    """Every controller socket is a unix socket in a folder only this user can enter, and the
    connection files say CurveZMQ is on."""
    import stat

    folder = magics.cluster.network.sockets
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert folder.stat().st_uid == os.getuid()
    sockets = [p for p in folder.iterdir() if p.is_socket() and not p.is_symlink()]
    assert len(sockets) >= 10
    for path in magics.cluster._cluster.controller.connection_files.values():
        info = json.loads(Path(path).read_text())
        assert info["interface"] == f"ipc://{folder}/s"
        assert len(info["curve_serverkey"]) == 40  # a Z85-encoded CurveZMQ public key
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
