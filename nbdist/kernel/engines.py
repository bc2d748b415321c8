"""The ranked view of a cluster's engines (:class:`RankedEngines`), and the local processes
behind them.

A rank is a *position* in the engines ordered by host address, then engine id, never the id
itself: ids change when engines are replaced. Ranks are contiguous per host (``LOCAL_RANK``,
GPU pinning), and rank 0's host is ``MASTER_ADDR``. Everything here is plain data in, plain
data out (``rank_engines``, the status text) or works on local PIDs (``kill_trees``,
``gone``, ``cpu_seconds``), so the cluster module keeps to ipyparallel itself.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nbdist.engine.hardware import is_loopback
from nbdist.errors import ClusterError

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 120.0  # importing TensorFlow on a busy 2-core machine takes ~10 s


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


def settle_addresses(infos: list[dict[str, Any]], *, local: str | None) -> list[dict[str, Any]]:
    """The address each engine's host is reached at: ``local`` for a cluster this kernel started
    (all on this machine), else the one each engine reported."""
    if local is not None:
        for info in infos:
            info["address"] = local
    elif len({info["host"] for info in infos}) > 1:
        # Several hosts, but the controller was reached over loopback (it listens on every
        # interface and this notebook runs on its host): an engine's route to "127.0.0.1" is
        # its own loopback. Use the host's own non-loopback address instead.
        for info in infos:
            if is_loopback(info["address"]):
                if not info["addresses"]:
                    raise ClusterError(
                        f"engine on {info['host']} has no address other hosts can reach; set "
                        "NBDIST_ADDRESS in its environment (ipcluster_config.py: "
                        "c.EngineLauncher.environment) and %distrain connect again."
                    )
                info["address"] = info["addresses"][0]
    return infos


def gpu_for_engine(gpus: Sequence[str], *, local_rank: int, local_world_size: int) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` an engine gets, from the GPUs it sees itself (``gpus``, see
    ``hardware.visible_gpus``) and its place among the engines of its host; None: no GPU.

    One GPU per engine, in local-rank order: engine ``local_rank`` of a host gets the
    ``local_rank``-th GPU the host shows it (with ``CUDA_VISIBLE_DEVICES=3,5`` set before the
    start, local rank 1 gets ``5``).
    """
    if local_world_size == 1 and gpus:
        return ",".join(gpus)  # alone on its host: MirroredStrategy may use every GPU
    if local_rank < len(gpus):
        return gpus[local_rank]
    # A launcher that binds one GPU per task (srun --gpus-per-task=1) already gave this engine
    # its own; otherwise more engines than GPUs: this one gets none.
    return gpus[0] if len(gpus) == 1 else None


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
        gpu = gpu_for_engine(info["gpus"], local_rank=local_rank, local_world_size=len(peers))
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
    """``%distrain status``: the hosts, then one line per rank (beyond ``PER_RANK_MAX``
    ranks, each host's busy and idle count instead, and the busy ranks)."""
    from nbdist.kernel.curves import PER_RANK_MAX

    hosts = by_host(engines)
    grouped = len(engines) > PER_RANK_MAX
    lines = [
        f"nbdist: {len(engines)} workers on {len(hosts)} host{'s' if len(hosts) > 1 else ''}, "
        f"{source}"
    ]
    for address, group in hosts.items():
        gpus = [e.gpu for e in group if e.gpu is not None]
        states = ""
        if grouped:
            n_busy = sum(1 for e in group if busy.get(e.rank))
            states = f", {n_busy} busy, {len(group) - n_busy} idle"
        lines.append(
            f"  {group[0].host} ({address}): {len(group)} engine"
            f"{'s' if len(group) > 1 else ''}, ranks {group[0].rank}-{group[-1].rank}, "
            f"GPUs {','.join(gpus) if gpus else 'none'}{states}"
        )
    if grouped:
        running = [e.rank for e in engines if busy.get(e.rank)]
        lines.append(f"busy ranks: {_spans(running) if running else 'none'}")
        if warm:
            lines.append(f"frameworks loaded: {', '.join(sorted(warm))}")
        return "\n".join(lines)
    lines.append(f"{'rank':>4}  {'engine':>6}  {'host':<20} {'pid':>8}  {'gpu':<5} {'state'}")
    for e in engines:
        state = "busy" if busy.get(e.rank) else "idle"
        gpu = e.gpu if e.gpu is not None else "-"
        lines.append(f"{e.rank:>4}  {e.engine_id:>6}  {e.host:<20} {e.pid:>8}  {gpu:<5} {state}")
    if warm:
        lines.append(f"frameworks loaded: {', '.join(sorted(warm))}")
    return "\n".join(lines)


def _spans(ranks: Sequence[int]) -> str:
    """``0-3, 7, 9-10`` for ranks 0, 1, 2, 3, 7, 9, 10 (sorted)."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


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


def shutdown_engines(client: Any, pids: list[int]) -> None:
    """Ask engines to exit, then SIGKILL any still there after a second.

    Engines that ran a gloo or TF collective often ignore SIGTERM, and the launcher would
    wait for each in turn; a shutdown request followed by SIGKILL takes one second at most.
    """
    import psutil

    try:
        client.shutdown(targets="all", hub=False, block=False)
    except Exception:  # engines already gone: nothing to ask
        log.debug("engine shutdown request failed", exc_info=True)
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=1)
    kill_trees(proc.pid for proc in alive)


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


class RankedEngines:
    """The engines of a cluster, by rank: run work on them, signal them, watch them.

    Mixed into :class:`~nbdist.kernel.cluster.LocalCluster`, which provides ``_client`` (the
    ipyparallel Client), ``engines`` (rank order) and ``owned`` (True when this kernel started
    the engines, so their processes are local and visible).
    """

    _client: Any
    engines: list[EngineInfo]
    owned: bool
    source: str
    warm: set[str]

    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def size(self) -> int:
        return len(self.engines)

    def apply_async(self, rank: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the engine of ``rank``; returns ipyparallel's AsyncResult."""
        return self._client[self.engines[rank].engine_id].apply_async(fn, *args, **kwargs)

    def apply_all(
        self,
        fn: Callable[..., Any],
        per_rank: Callable[[EngineInfo], dict],
        ranks: Sequence[int] | None = None,
    ) -> list:
        """Run ``fn(**per_rank(engine))`` on every engine (or ``ranks``) at once; in rank order.

        Set-up work (imports, a rendezvous): an engine that does not answer within
        ``SETUP_TIMEOUT_S`` is a ClusterError naming its rank, not a wait without end.
        """
        chosen = self.engines if ranks is None else [self.engines[r] for r in ranks]
        ars = [self.apply_async(e.rank, fn, **per_rank(e)) for e in chosen]
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        out = []
        for e, ar in zip(chosen, ars, strict=True):
            try:
                out.append(ar.get(max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                raise ClusterError(
                    f"rank {e.rank} (host {e.host}, pid {e.pid}) did not answer within "
                    f"{SETUP_TIMEOUT_S:g} s while setting up; is a cell still running there? "
                    "%distrain status shows it; %distrain restart gives fresh workers."
                ) from None
        return out

    def interrupt(self, ranks: Sequence[int]) -> None:
        """SIGINT the engines of ``ranks`` (a KeyboardInterrupt in the running cell)."""
        targets = [self.engines[r].engine_id for r in ranks]
        if targets:
            self._client.send_signal(signal.SIGINT, targets=targets, block=False)

    def kill(self, ranks: Sequence[int]) -> None:
        """SIGKILL the engines of ``ranks``: for ranks that ignored the interrupt."""
        if not self.owned:  # engines may be on other hosts: their nannies deliver the signal
            targets = [self.engines[r].engine_id for r in ranks]
            if targets:
                self._client.send_signal(signal.SIGKILL, targets=targets, block=False)
            return
        kill_trees(self.engines[r].pid for r in ranks)

    def dead(self, ranks: Sequence[int]) -> list[int]:
        """Which of ``ranks`` have an engine process that is gone (or a zombie)."""
        if not self.owned:  # no process to look at: an engine is dead when the hub says so
            alive = set(self._client.ids)
            return [r for r in ranks if self.engines[r].engine_id not in alive]
        return [r for r in ranks if gone(self.engines[r].pid)]

    def cpu_seconds(self, ranks: Sequence[int]) -> dict[int, float] | None:
        """CPU time (user + system) each rank's engine process has used; None when nbdist cannot
        see the processes (a connected cluster, whose engines may be on other hosts)."""
        if not self.owned:
            return None
        seconds = {r: cpu_seconds(self.engines[r].pid) for r in ranks}
        return {r: t for r, t in seconds.items() if t is not None}

    def busy(self) -> dict[int, int]:
        """Tasks queued or running per rank."""
        status = self._client.queue_status()
        return {
            e.rank: status.get(e.engine_id, {}).get("queue", 0)
            + status.get(e.engine_id, {}).get("tasks", 0)
            for e in self.engines
        }

    def connected_text(self) -> str:
        return connected_text(self.engines)

    def status_text(self) -> str:
        if not self.running:
            return "nbdist: no cluster running. %distrain start [-n N] starts one."
        return status_text(self.engines, source=self.source, busy=self.busy(), warm=self.warm)
