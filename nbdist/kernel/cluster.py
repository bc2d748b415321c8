"""The engines jobs run on. The only module that touches ipyparallel's Cluster and Client.

nbdist starts a local cluster (controller on loopback) on first use and keeps it across cells.
Engines are ordered by engine id and a rank is a *position* in that order, never the id itself:
ids change when engines are replaced.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbdist.engine import worker
from nbdist.engine.hardware import visible_gpus
from nbdist.errors import ClusterError

log = logging.getLogger(__name__)

DEFAULT_CPU_WORKERS = 2
ENGINE_START_TIMEOUT_S = 120
LOOPBACK = "127.0.0.1"


def default_workers() -> int:
    """One worker per visible GPU; 2 on a CPU-only machine."""
    return len(visible_gpus()) or DEFAULT_CPU_WORKERS


def clean_stale(directory: str | None = None) -> int:
    """Kill the cluster processes of kernels that died without stopping them; returns how many.

    The reaper normally does this; this catches what it could not (say the reaper was killed
    too). Each running cluster has a PID file ``nbdist-<kernel pid>-*.pids`` in the temp
    directory; one whose kernel is gone belongs to nobody.
    """
    import glob

    import psutil

    from nbdist.kernel.reaper import _kill_tree, _read_pids

    killed = 0
    for path in glob.glob(os.path.join(directory or tempfile.gettempdir(), "nbdist-*-*.pids")):
        try:
            kernel_pid = int(os.path.basename(path).split("-")[1])
        except (IndexError, ValueError):
            continue
        if psutil.pid_exists(kernel_pid):
            continue
        for pid in _read_pids(path):
            if psutil.pid_exists(pid):
                _kill_tree(pid)
                killed += 1
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return killed


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


@dataclass
class Rendezvous:
    """A framework's live rendezvous on the current engines: the key it was made for and envs."""

    key: tuple[Any, ...]
    envs: list[dict[str, str]] = field(default_factory=list)


class LocalCluster:
    """A local ipyparallel cluster owned by this kernel, stopped when the kernel exits.

    Parameters
    ----------
    notify : callable
        Receives the one-line notices a user should see (starting, resizing, replacing).
    """

    def __init__(self, *, notify: Callable[[str], None] = log.info) -> None:
        self._notify = notify
        self._cluster: Any = None
        self._client: Any = None
        self._reaper: subprocess.Popen | None = None
        self._pidfile: str | None = None
        self.engines: list[EngineInfo] = []
        self.warm: set[str] = set()
        self.rendezvous: dict[str, Rendezvous] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._cluster is not None

    @property
    def size(self) -> int:
        return len(self.engines)

    def start(self, n: int | None = None) -> None:
        """Start a controller on loopback and ``n`` engines, and learn what each can use."""
        import ipyparallel as ipp
        from traitlets.config import Config

        if self.running:
            return
        n = n or default_workers()
        self._check_gpus(n)
        cleaned = clean_stale()
        if cleaned:
            self._notify(
                f"nbdist: stopped {cleaned} leftover cluster process"
                f"{'es' if cleaned > 1 else ''} of a kernel that had crashed"
            )
        config = Config()
        # Engines that ran a collective may ignore SIGTERM: don't wait 5 s before SIGKILL.
        config.LocalProcessLauncher.stop_seconds_until_kill = 1
        workers = f"{n} worker{'s' if n > 1 else ''}"
        self._notify(f"nbdist: starting {workers} (local ipyparallel cluster on {LOOPBACK})")
        start = time.perf_counter()
        cluster = ipp.Cluster(
            n=n,
            controller_ip=LOOPBACK,
            # WARNING would print every replaced engine's whole log into the cell.
            log_level=logging.ERROR,
            config=config,
            load_profile=False,
        )
        try:
            self._start_reaper()
            cluster.start_cluster_sync()
            self._cluster = cluster
            # Registered after ipyparallel's own handler, so it runs first (atexit is LIFO).
            atexit.register(self.stop)
            self._client = cluster.connect_client_sync()
            self._client.wait_for_engines(n, timeout=ENGINE_START_TIMEOUT_S, interactive=False)
            self._learn_engines()
        except Exception as e:
            self.stop()
            raise ClusterError(
                f"could not start {n} local engines: {e}. Check that ipyparallel is installed in "
                "this kernel's environment, then run %distrain start again."
            ) from e
        log.info("cluster with %d engines up in %.1f s", n, time.perf_counter() - start)

    def stop(self) -> None:
        """Stop engines and controller; no process is left behind."""
        cluster, client = self._cluster, self._client
        pids = [e.pid for e in self.engines]
        self._cluster = self._client = None
        atexit.unregister(self.stop)
        self._forget_engines()
        if client is not None:
            if cluster is not None and cluster.engines and pids:
                self._shutdown_engines(client, pids)
            try:
                client.close()
            except Exception:  # a closing client can only fail on its own sockets
                log.debug("client close failed", exc_info=True)
        if cluster is not None:
            cluster.stop_cluster_sync()
        self._stop_reaper()

    @staticmethod
    def _shutdown_engines(client: Any, pids: list[int]) -> None:
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
        for proc in alive:
            try:
                for child in proc.children(recursive=True):
                    child.kill()
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def _start_reaper(self) -> None:
        fd, self._pidfile = tempfile.mkstemp(prefix=f"nbdist-{os.getpid()}-", suffix=".pids")
        os.close(fd)
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "nbdist.kernel.reaper", str(os.getpid()), self._pidfile],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _write_pidfile(self) -> None:
        pids = [self._cluster.controller.pid, *(e.pid for e in self.engines)]
        tmp = self._pidfile + ".tmp"
        with open(tmp, "w") as f:
            f.write(" ".join(map(str, pids)))
        os.replace(tmp, self._pidfile)

    def _stop_reaper(self) -> None:
        pidfile, reaper = self._pidfile, self._reaper
        self._pidfile = self._reaper = None
        if pidfile is not None and os.path.exists(pidfile):
            os.unlink(pidfile)
        if reaper is not None:
            try:
                reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()

    def restart(self, n: int | None = None) -> None:
        n = n or self.size or None
        self.stop()
        self.start(n)

    def ensure(self, n: int | None) -> None:
        """Have a cluster of ``n`` engines (keep the running one when ``n`` is None or equal)."""
        if not self.running:
            self.start(n)
        elif n is not None and n != self.size:
            self._notify(f"nbdist: resizing the cluster from {self.size} to {n} workers")
            self.replace_engines(n)

    def replace_engines(self, n: int | None = None) -> None:
        """Stop every engine and start ``n`` fresh ones under the same controller."""
        n = n or self.size
        self._check_gpus(n)
        self._shutdown_engines(self._client, [e.pid for e in self.engines])
        self._forget_engines()
        self._cluster.stop_engines_sync()
        self._cluster.start_engines_sync(n)
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while len(self._client.ids) != n:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self._client.ids)} of {n} engines came back; run %distrain restart"
                )
            time.sleep(0.05)
        self._learn_engines()

    def _forget_engines(self) -> None:
        self.engines = []
        self.warm = set()
        self.rendezvous = {}

    def _check_gpus(self, n: int) -> None:
        from IPython.core.error import UsageError

        gpus = visible_gpus()
        if gpus and n > len(gpus):
            raise UsageError(
                f"%%distrain: -n {n} asks for more workers than the {len(gpus)} visible GPUs "
                f"(one worker per GPU); use -n {len(gpus)}."
            )

    def _learn_engines(self) -> None:
        ids = sorted(self._client.ids)
        infos = self._client[ids].apply_sync(worker.engine_info)
        by_host: dict[str, list[int]] = {}
        for rank, info in enumerate(infos):
            by_host.setdefault(info["host"], []).append(rank)
        engines = []
        for rank, (eid, info) in enumerate(zip(ids, infos, strict=True)):
            peers = by_host[info["host"]]
            local_rank = peers.index(rank)
            gpus = info["gpus"]
            if len(peers) == 1 and gpus:
                gpu = ",".join(gpus)  # alone on its host: MirroredStrategy may use every GPU
            else:
                gpu = gpus[local_rank] if local_rank < len(gpus) else None
            engines.append(
                EngineInfo(
                    rank=rank,
                    engine_id=eid,
                    host=info["host"],
                    address=LOOPBACK,
                    pid=info["pid"],
                    gpu=gpu,
                    cpus=info["cpus"],
                    local_rank=local_rank,
                    local_world_size=len(peers),
                )
            )
        self._client[ids].map_sync(worker.pin_gpu, [e.gpu for e in engines])
        self.engines = engines
        self._write_pidfile()

    # -- work ------------------------------------------------------------------------------------
    def apply_async(self, rank: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the engine of ``rank``; returns ipyparallel's AsyncResult."""
        return self._client[self.engines[rank].engine_id].apply_async(fn, *args, **kwargs)

    def apply_all(
        self,
        fn: Callable[..., Any],
        per_rank: Callable[[EngineInfo], dict],
        ranks: Sequence[int] | None = None,
    ) -> list:
        """Run ``fn(**per_rank(engine))`` on every engine (or ``ranks``) at once; in rank order."""
        chosen = self.engines if ranks is None else [self.engines[r] for r in ranks]
        ars = [self.apply_async(e.rank, fn, **per_rank(e)) for e in chosen]
        return [ar.get() for ar in ars]

    def interrupt(self, ranks: Sequence[int]) -> None:
        """SIGINT the engines of ``ranks`` (a KeyboardInterrupt in the running cell)."""
        targets = [self.engines[r].engine_id for r in ranks]
        if targets:
            self._client.send_signal(signal.SIGINT, targets=targets, block=False)

    def kill(self, ranks: Sequence[int]) -> None:
        """SIGKILL the engines of ``ranks``: for ranks that ignored the interrupt."""
        for r in ranks:
            try:
                os.kill(self.engines[r].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def dead(self, ranks: Sequence[int]) -> list[int]:
        """Which of ``ranks`` have an engine process that is gone (or a zombie)."""
        import psutil

        gone = []
        for r in ranks:
            try:
                if psutil.Process(self.engines[r].pid).status() == psutil.STATUS_ZOMBIE:
                    gone.append(r)
            except psutil.NoSuchProcess:
                gone.append(r)
        return gone

    def busy(self) -> dict[int, int]:
        """Tasks queued or running per rank."""
        status = self._client.queue_status()
        return {
            e.rank: status.get(e.engine_id, {}).get("queue", 0)
            + status.get(e.engine_id, {}).get("tasks", 0)
            for e in self.engines
        }

    def status_text(self) -> str:
        if not self.running:
            return "nbdist: no cluster running. %distrain start [-n N] starts one."
        busy = self.busy()
        lines = [f"nbdist: {self.size} workers on a local ipyparallel cluster ({LOOPBACK})"]
        lines.append(f"{'rank':>4}  {'engine':>6}  {'host':<20} {'pid':>8}  {'gpu':<5} {'state'}")
        for e in self.engines:
            state = "busy" if busy.get(e.rank) else "idle"
            gpu = e.gpu if e.gpu is not None else "-"
            lines.append(
                f"{e.rank:>4}  {e.engine_id:>6}  {e.host:<20} {e.pid:>8}  {gpu:<5} {state}"
            )
        if self.warm:
            lines.append(f"frameworks loaded: {', '.join(sorted(self.warm))}")
        return "\n".join(lines)
