"""The ranked view of a cluster's engines, and the local processes behind them.

A rank is a *position* in the engines ordered by host address, then engine id, never the id
itself: ids change when engines are replaced. Ranks are contiguous per host (``LOCAL_RANK``,
GPU pinning), and rank 0's host is ``MASTER_ADDR``. Everything here is plain data in, plain
data out (``rank_engines``, the status text) or works on local PIDs (``kill_trees``,
``gone``, ``cpu_seconds``), so the cluster module keeps to ipyparallel itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    """One engine, in rank order: where it runs and what it may use."""

    rank: int
    engine_id: int
    host: str
    address: str
    pid: int
    gpu: str | None
    cpus: int
    local_rank: int
    local_world_size: int


def _host_key(address: str) -> tuple[Any, ...]:
    """Sort hosts by address (numerically for IPv4), so ranks are contiguous per host."""
    parts = address.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return (0, *(int(p) for p in parts))
    return (1, address)


def rank_engines(ids: Sequence[int], infos: Sequence[dict[str, Any]]) -> list[EngineInfo]:
    """Engines in rank order, from their ids and what each reported (``worker.engine_info``
    with its ``address`` settled): local ranks per host address, and one GPU each."""
    order = sorted(range(len(ids)), key=lambda i: (_host_key(infos[i]["address"]), ids[i]))
    ids, infos = [ids[i] for i in order], [infos[i] for i in order]
    by_host: dict[str, list[int]] = {}
    for rank, info in enumerate(infos):
        by_host.setdefault(info["address"], []).append(rank)
    engines = []
    for rank, (eid, info) in enumerate(zip(ids, infos, strict=True)):
        peers = by_host[info["address"]]
        local_rank = peers.index(rank)
        gpus = info["gpus"]
        if len(peers) == 1 and gpus:
            gpu = ",".join(gpus)  # alone on its host: MirroredStrategy may use every GPU
        elif local_rank < len(gpus):
            gpu = gpus[local_rank]
        else:
            # A launcher that binds one GPU per task (srun --gpus-per-task=1) already gave
            # this engine its own; otherwise more engines than GPUs: this one gets none.
            gpu = gpus[0] if len(gpus) == 1 else None
        engines.append(
            EngineInfo(
                rank=rank,
                engine_id=eid,
                host=info["host"],
                address=info["address"],
                pid=info["pid"],
                gpu=gpu,
                cpus=info["cpus"],
                local_rank=local_rank,
                local_world_size=len(peers),
            )
        )
    return engines


def by_host(engines: Iterable[EngineInfo]) -> dict[str, list[EngineInfo]]:
    """Engines per host address, in rank order."""
    hosts: dict[str, list[EngineInfo]] = {}
    for e in engines:
        hosts.setdefault(e.address, []).append(e)
    return hosts


def connected_text(engines: Sequence[EngineInfo]) -> str:
    """One line after ``%distrain connect``: engines per host address."""
    hosts = by_host(engines)
    per_host = ", ".join(
        f"{a}: {len(es)} engine{'s' if len(es) > 1 else ''}" for a, es in hosts.items()
    )
    return (
        f"nbdist: connected to {len(engines)} engines on {len(hosts)} "
        f"host{'s' if len(hosts) > 1 else ''} ({per_host}); %distrain status shows them"
    )


def status_text(
    engines: Sequence[EngineInfo], *, source: str, busy: dict[int, int], warm: Iterable[str]
) -> str:
    """``%distrain status``: the hosts, then one line per rank."""
    hosts = by_host(engines)
    lines = [
        f"nbdist: {len(engines)} workers on {len(hosts)} host{'s' if len(hosts) > 1 else ''}, "
        f"{source}"
    ]
    for address, group in hosts.items():
        gpus = [e.gpu for e in group if e.gpu is not None]
        lines.append(
            f"  {group[0].host} ({address}): {len(group)} engine"
            f"{'s' if len(group) > 1 else ''}, ranks {group[0].rank}-{group[-1].rank}, "
            f"GPUs {','.join(gpus) if gpus else 'none'}"
        )
    lines.append(f"{'rank':>4}  {'engine':>6}  {'host':<20} {'pid':>8}  {'gpu':<5} {'state'}")
    for e in engines:
        state = "busy" if busy.get(e.rank) else "idle"
        gpu = e.gpu if e.gpu is not None else "-"
        lines.append(f"{e.rank:>4}  {e.engine_id:>6}  {e.host:<20} {e.pid:>8}  {gpu:<5} {state}")
    if warm:
        lines.append(f"frameworks loaded: {', '.join(sorted(warm))}")
    return "\n".join(lines)


# -- local engine processes (a cluster this kernel started) -----------------------------------
def kill_trees(pids: Iterable[int]) -> None:
    """SIGKILL each process and everything it started (what the cell ran: loaders, shells)."""
    import psutil

    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def gone(pid: int) -> bool:
    """Whether the process is gone (or a zombie)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) of the process and its children; None if it cannot be read."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]  # subprocesses, loader workers
    except psutil.Error:
        return None
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total
