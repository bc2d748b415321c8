"""The ranked view of a cluster's engines (:class:`RankedEngines`), and the local processes
behind them.

A rank is a *position* in the engines ordered by host address, then engine id, never the id
itself: ids change when engines are replaced. Ranks are contiguous per host (``LOCAL_RANK``,
GPU pinning), and rank 0's host is ``MASTER_ADDR``. Plain data in, plain data out
(``rank_engines``, the status text), and the part of a cluster both kinds share
(:class:`RankedEngines`).
"""

from __future__ import annotations

import enum
import logging
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbdist.engine import worker
from nbdist.engine.hardware import is_loopback
from nbdist.errors import ClusterError
from nbdist.protocol import EngineReport, SlurmTask
from nbdist.ranks import MANY_RANKS, spans

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
    gpu: str | None  # the GPU its rank uses, as CUDA_VISIBLE_DEVICES names it; None: the CPU
    visible: str  # the CUDA_VISIBLE_DEVICES it runs with ("": no GPU)
    cuda_index: int | None  # its device is cuda:<cuda_index>
    cpus: int
    local_rank: int
    local_world_size: int
    interface: str | None = None  # the network interface its address is on
    slurm: SlurmTask | None = None  # the Slurm job and task it runs as (srun started it)


def _host_key(address: str) -> tuple[Any, ...]:
    """Sort hosts by address (numerically for IPv4), so ranks are contiguous per host."""
    parts = address.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return (0, *(int(p) for p in parts))
    return (1, address)


def settle_addresses(infos: list[EngineReport], *, local: str | None) -> list[EngineReport]:
    """The address each engine's host is reached at: ``local`` for a cluster this kernel started
    (all on this machine), else the one each engine reported."""
    if local is not None:
        return [replace(info, address=local) for info in infos]
    if len({info.host for info in infos}) <= 1:
        return infos
    # Several hosts, but the controller was reached over loopback (it listens on every
    # interface and this notebook runs on its host): an engine's route to "127.0.0.1" is its
    # own loopback. Use the host's own non-loopback address instead.
    out = []
    for info in infos:
        if info.address is None or is_loopback(info.address):
            if not info.addresses:
                raise ClusterError(
                    f"engine on {info.host} has no address other hosts can reach; set "
                    "NBDIST_ADDRESS in its environment (ipcluster_config.py: "
                    "c.EngineLauncher.environment) and %distrain connect again."
                )
            info = replace(info, address=info.addresses[0])
        out.append(info)
    return out


def gpus_for_host(seen: Sequence[Sequence[str]]) -> list[tuple[str | None, str, int | None]]:
    """For the engines of one host, in local-rank order, from the GPUs each sees itself
    (``hardware.visible_gpus``): ``(gpu, visible, index)`` each: the GPU its rank uses (None: the
    CPU), the ``CUDA_VISIBLE_DEVICES`` it runs with, and its device, ``cuda:<index>``.

    As under torchrun, every engine of a host sees the host's GPUs that the cluster uses, in
    local-rank order, and uses ``cuda:<local rank>``: libraries that pick ``cuda:LOCAL_RANK``
    (accelerate, Lightning, ``Trainer``) find their GPU. With ``CUDA_VISIBLE_DEVICES=3,5`` set
    before the start, local rank 1 uses GPU 5 as ``cuda:1``. Alone on its host, an engine sees
    every GPU (``MirroredStrategy`` may use them all). Engines a launcher bound to one GPU each
    (``srun --gpus-per-task=1``) keep theirs, as ``cuda:0``. Fewer GPUs than engines: the CPU
    for each (two processes cannot share a GPU under nccl), and the start says so.
    """
    n = len(seen)
    if n > 1 and all(len(s) == 1 for s in seen) and len({s[0] for s in seen}) == n:
        return [(s[0], s[0], 0) for s in seen]
    out: list[tuple[str | None, str, int | None]] = []
    for local_rank, own in enumerate(seen):
        if n == 1 and own:
            out.append((",".join(own), ",".join(own), 0))
        elif len(own) >= n:
            used = list(own[:n])
            out.append((used[local_rank], ",".join(used), local_rank))
        else:
            out.append((None, "", None))
    return out


def _rank_key(info: EngineReport, engine_id: int, jobs: set[str]) -> tuple[Any, ...]:
    """Where an engine goes in rank order. Engines of one Slurm job step go as Slurm numbers its
    tasks, by node then ``SLURM_LOCALID``, so that rank and ``SLURM_PROCID`` agree (with srun's
    block distribution); any other engines by host address, then engine id."""
    if info.slurm is not None and len(jobs) == 1:
        return (info.slurm.node, info.slurm.local)
    local = info.slurm.local if info.slurm is not None else -1
    return (_host_key(str(info.address)), local, engine_id)


def rank_engines(ids: Sequence[int], infos: Sequence[EngineReport]) -> list[EngineInfo]:
    """Engines in rank order, from their ids and what each reported (``worker.engine_info``
    with its ``address`` settled): local ranks per host address, and a GPU each
    (:func:`gpus_for_host`)."""
    jobs = {info.slurm.job if info.slurm else "" for info in infos}
    order = sorted(range(len(ids)), key=lambda i: _rank_key(infos[i], ids[i], jobs))
    ids, infos = [ids[i] for i in order], [infos[i] for i in order]
    by_host: dict[str, list[int]] = {}
    for rank, info in enumerate(infos):
        by_host.setdefault(str(info.address), []).append(rank)
    gpus = {
        address: gpus_for_host([infos[r].gpus for r in ranks]) for address, ranks in by_host.items()
    }
    engines = []
    for rank, (eid, info) in enumerate(zip(ids, infos, strict=True)):
        address = str(info.address)
        peers = by_host[address]
        local_rank = peers.index(rank)
        gpu, visible, index = gpus[address][local_rank]
        engines.append(
            EngineInfo(
                rank=rank,
                engine_id=eid,
                host=info.host,
                address=address,
                pid=info.pid,
                gpu=gpu,
                visible=visible,
                cuda_index=index,
                cpus=info.cpus,
                local_rank=local_rank,
                local_world_size=len(peers),
                interface=info.interfaces.get(address),
                slurm=info.slurm,
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
    engines: Sequence[EngineInfo],
    *,
    source: str,
    busy: dict[int, int],
    warm: Iterable[str],
    dead: dict[int, str] | None = None,
    advice: str | None = None,
    notes: Sequence[str] = (),
    running: dict[int, str] | None = None,
) -> str:
    """``%distrain status``: the hosts, then one line per rank (beyond ``MANY_RANKS``
    ranks, each host's busy and idle count instead, and the busy ranks); ``advice``: what the
    next cell does about dead ranks (``DEAD_ADVICE`` by default); ``notes``: lines on the
    cluster itself (its network), after the ranks; ``running``: the cell a busy rank still
    runs, as the notebook named it (a connected engine that ignored the interrupt)."""
    advice = advice or DEAD_ADVICE
    hosts = by_host(engines)
    grouped = len(engines) > MANY_RANKS
    lines = [
        f"nbdist: {len(engines)} worker{'s' if len(engines) != 1 else ''} on {len(hosts)} "
        f"host{'s' if len(hosts) != 1 else ''}, {source}"
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
        busy_ranks = [e.rank for e in engines if busy.get(e.rank)]
        lines.append(f"busy ranks: {spans(busy_ranks) if busy_ranks else 'none'}")
        if dead:
            lines.append(f"dead ranks: {spans(sorted(dead))}. {advice}")
        if warm:
            lines.append(f"frameworks loaded: {', '.join(sorted(warm))}")
        return "\n".join([*lines, *notes])
    lines.append(f"{'rank':>4}  {'engine':>6}  {'host':<20} {'pid':>8}  {'gpu':<5} {'state'}")
    dead = dead or {}
    for e in engines:
        state = "busy" if busy.get(e.rank) else "idle"
        still = (running or {}).get(e.rank)
        if busy.get(e.rank) and still:
            state = f"busy: still runs {still}"
        if e.rank in dead:
            state = f"dead: {dead[e.rank]}" if dead[e.rank] else "dead"
        gpu = e.gpu if e.gpu is not None else "-"
        lines.append(f"{e.rank:>4}  {e.engine_id:>6}  {e.host:<20} {e.pid:>8}  {gpu:<5} {state}")
    if warm:
        lines.append(f"frameworks loaded: {', '.join(sorted(warm))}")
    lines += notes
    if dead:
        lines.append(advice)
    return "\n".join(lines)


DEAD_ADVICE = (
    "The next %%distrain cell replaces the workers (their variables are lost); "
    "%distrain restart does it now."
)
HEAL_ADVICE = (  # healing on (the default), and a session it can heal
    "The next %%distrain cell heals the session (new engines get a survivor's variables); "
    "%distrain restart starts over."
)


def exit_text(code: int | None) -> str:
    """How a process ended, in words, from its exit code (negative: the signal that killed it,
    as psutil and subprocess give it); "" when unknown."""
    if code is None:
        return ""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = {
            int(signal.SIGKILL): " (kill -9, or the kernel's out-of-memory killer)",
            int(signal.SIGSEGV): " (a crash in native code)",
            int(signal.SIGABRT): " (a native library aborted)",
        }.get(-code, "")
        return f"killed by {name}{why}"
    return f"exited with status {code} (os._exit(), or a native library's exit())"


class RankedEngines:
    """The engines of a cluster, by rank: run work on them, signal them, watch them.

    The part both kinds of cluster share (:class:`~nbdist.kernel.local.LocalCluster`, started
    by this kernel, and :class:`~nbdist.kernel.connected.ConnectedCluster`, started elsewhere):
    the ipyparallel Client, the engines in rank order, and ``on_change``, called with a note
    (or None) whenever the engines change, for the session to drop what lived on them. What
    differs (how an engine is killed, seen dead, replaced) each kind says for itself.
    """

    source: str = ""
    STARTS_ENGINES = False  # nbdist started them, and can replace them all
    network: Any = None  # the workers' private network (a local cluster's)
    stale: str | None = None  # why a connected cluster cannot run jobs any more

    def __init__(self, *, notify: Callable[[str], None] = log.info) -> None:
        self._notify = notify
        self._client: Any = None
        self.engines: list[EngineInfo] = []
        self.on_change: Callable[[str | None], None] = lambda note: None

    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def size(self) -> int:
        return len(self.engines)

    def apply_async(self, rank: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the engine of ``rank``; returns ipyparallel's AsyncResult. An engine
        the controller no longer has (it died) is a ClusterError that says so."""
        try:
            view = self._client[self.engines[rank].engine_id]
        except IndexError:  # ipyparallel's "No such engine"
            raise ClusterError(f"{self.gone_text([rank])}. {DEAD_ADVICE}") from None
        return view.apply_async(fn, *args, **kwargs)

    # -- what each kind says for itself ------------------------------------------------------------
    def exit_status(self, rank: int) -> int | None:
        """How the engine of ``rank`` ended (exit code; negative: the signal), None when it
        runs or nbdist cannot tell (engines it did not start)."""
        return None

    def how_ended(self, rank: int) -> str:
        """How the engine of ``rank`` ended, in words ("" when unknown): its exit code or
        signal, and what killed it when the machine says (see :meth:`note_memory`)."""
        return exit_text(self.exit_status(rank))

    def note_memory(self) -> None:
        """Note where the engines' memory is counted, to tell an out-of-memory kill from a
        ``kill -9`` after a death (engines on this machine only)."""

    def dead(self, ranks: Sequence[int]) -> list[int]:
        """Which of ``ranks`` have an engine that is gone."""
        raise NotImplementedError

    def kill(self, ranks: Sequence[int]) -> bool:
        """SIGKILL the engines of ``ranks`` (ranks that ignored the interrupt); False when
        they are not nbdist's to kill."""
        raise NotImplementedError

    def cpu_seconds(self, ranks: Sequence[int]) -> dict[int, float] | None:
        """CPU time each rank's engine process has used; None when nbdist cannot see the
        processes."""
        return None

    # -- shared ------------------------------------------------------------------------------------
    def dead_reasons(self, ranks: Sequence[int] | None = None) -> dict[int, str]:
        """The ranks (of ``ranks``, or all) whose engine is gone, and how each ended."""
        chosen = range(self.size) if ranks is None else ranks
        return {r: self.how_ended(r) for r in self.dead(chosen)}

    def gone_text(self, ranks: Sequence[int], *, when: str = "") -> str:
        """``rank 1 (host a, pid 12) died after its last cell (killed by SIGKILL)``, for each."""
        parts = []
        for r in ranks:
            e = self.engines[r]
            how = self.how_ended(r)
            parts.append(
                f"rank {r} (host {e.host}, pid {e.pid}) died{when}{f': {how}' if how else ''}"
            )
        return "; ".join(parts)

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

        def late(rank: int) -> ClusterError:
            e = self.engines[rank]
            return ClusterError(
                f"rank {e.rank} (host {e.host}, pid {e.pid}) did not answer within "
                f"{SETUP_TIMEOUT_S:g} s while setting up; is a cell still running there? "
                "%distrain status shows it; %distrain restart gives fresh workers."
            )

        return gather([e.rank for e in chosen], ars, SETUP_TIMEOUT_S, late=late)

    def interrupt(self, ranks: Sequence[int]) -> None:
        """SIGINT the engines of ``ranks`` (a KeyboardInterrupt in the running cell)."""
        targets = [self.engines[r].engine_id for r in ranks]
        if targets:
            self._client.send_signal(signal.SIGINT, targets=targets, block=False)

    def ask_to_stop(self, ranks: Sequence[int]) -> None:
        """Ask the engines of ``ranks`` to stop their cell at the next step boundary they all
        reach (``nbdist.engine.stopping``; through ipyparallel, as the interrupt goes)."""
        from nbdist.engine.stopping import STOP_SIGNAL

        targets = [self.engines[r].engine_id for r in ranks]
        if targets:
            self._client.send_signal(STOP_SIGNAL, targets=targets, block=False)

    def busy(self) -> dict[int, int]:
        """Tasks queued or running per rank (none for an engine the controller dropped).

        The hub learns that a task ended from the scheduler's monitor stream, the notebook's
        client from the engine's reply itself, so right after a cell the hub may still list
        its tasks: those whose result this client already holds are not counted (another
        client's tasks on a connected cluster are).
        """
        client = self._client
        status = client.queue_status(verbose=True)
        done = set(client.history) - set(client.outstanding)

        def pending(engine_id: int) -> int:
            queues = status.get(engine_id, {})
            return sum(
                1 for key in ("queue", "tasks") for m in queues.get(key, ()) if m not in done
            )

        return {e.rank: pending(e.engine_id) for e in self.engines}

    def connected_text(self) -> str:
        return connected_text(self.engines)

    def status_text(
        self,
        warm: Iterable[str] = (),
        *,
        advice: str | None = None,
        running: dict[int, str] | None = None,
    ) -> str:
        if not self.running:
            return "nbdist: no cluster running. %distrain start [-n N] starts one."
        return status_text(
            self.engines,
            source=self.source,
            busy=self.busy(),
            warm=warm,
            dead=self.dead_reasons(),
            advice=advice,
            notes=self.status_notes(),
            running=running,
        )

    def status_notes(self) -> list[str]:
        """Lines on the cluster for ``%distrain status`` (the local one: its network)."""
        return []

    def outside_stop(self) -> str:
        """Who stopped a cell at a step boundary when the notebook did not ask."""
        return "a stop signal (SIGUSR1) sent to the workers from outside the notebook"

    def _forget_engines(self, note: str | None = None) -> None:
        """The engines are gone or about to change: the session hears of it (``note``: what to
        tell the user if variables lived on them; None: the caller tells)."""
        had = bool(self.engines)
        self.engines = []
        if had:
            self.on_change(note)

    def _learn_engines(self, ids: list[int] | None = None, *, timeout: float | None = None) -> None:
        """Rank the engines of ``ids`` (all the controller has by default): ask each what it is,
        order them by host, pin their GPUs."""
        ids = sorted(self._client.ids) if ids is None else ids
        infos = self._client[ids].apply_async(worker.engine_info, self._peer()).get(timeout=timeout)
        engines = rank_engines(ids, self._settle(infos))
        self._pin_gpus(engines)
        self._learned(engines)
        self.engines = engines

    def _pin_gpus(self, engines: Sequence[EngineInfo]) -> None:
        """Give each of ``engines`` the GPU its rank has (``worker.use_gpus``)."""
        self._client[[e.engine_id for e in engines]].map_sync(
            worker.use_gpus, [e.visible for e in engines], [e.cuda_index for e in engines]
        )

    def _registered(
        self,
        old: set[int],
        n: int,
        timeout: float,
        *,
        exited: Callable[[], str | None] = lambda: None,
    ) -> list[int]:
        """The ids of ``n`` engines registered after ``old``, once all are there; a
        ClusterError when ``exited`` says one of them exited, or when they do not all come
        within ``timeout`` seconds.

        A killed engine stays listed for up to the heartbeat's 10 s: counting every id would let
        a dead one plus a new one pass for two engines.
        """
        deadline = time.monotonic() + timeout
        while True:
            new = sorted(set(self._client.ids) - old)
            if len(new) >= n:
                return new[:n]
            why = exited()
            if why is not None:
                raise ClusterError(why)
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(new)} of {n} new engines registered within {timeout:g} s"
                )
            time.sleep(0.05)

    def _peer(self) -> str:
        """The controller's address as the engines should look for it."""
        raise NotImplementedError

    def _settle(self, infos: list[EngineReport]) -> list[EngineReport]:
        return infos

    def _learned(self, engines: list[EngineInfo]) -> None:
        """What a kind does with newly ranked engines before they are used."""


def remote_message(e: Exception) -> str:
    """What went wrong on an engine, in one line: ``ValueError: ...`` (a RemoteError's own
    name and value), or an UnpackError's words alone (they say what and why)."""
    from nbdist.protocol import UnpackError

    ename, evalue = getattr(e, "ename", None), getattr(e, "evalue", None)
    if isinstance(e, UnpackError) or ename == UnpackError.__name__:
        return str(evalue if ename else e)
    return f"{ename}: {evalue}" if ename else f"{type(e).__name__}: {e}"


class Status(enum.Enum):
    """How one rank's task ended, as :func:`reply` reads ipyparallel's answer."""

    OK = "ok"
    FAILED = "failed"  # it raised (``Reply.error``: ipyparallel's RemoteError, or the client's)
    LATE = "late"  # no answer within the time given
    DIED = "died"  # ipyparallel failed it because its engine died (the engine's nanny said so)


@dataclass(frozen=True)
class Reply:
    """One rank's task: how it ended, and its value or its error."""

    rank: int
    status: Status
    value: Any = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


ENGINE_DIED = "EngineError"  # what ipyparallel names the error of a task whose engine died


def engine_died(error: BaseException) -> bool:
    """Whether ipyparallel failed a task itself because its engine died: a ``RemoteError`` (or
    the client's own ``EngineError``) named ``EngineError``."""
    return getattr(error, "ename", type(error).__name__) == ENGINE_DIED


def reply(rank: int, ar: Any, timeout: float) -> Reply:
    """The task ``ar`` of ``rank``, waited for up to ``timeout`` seconds (0: as it is now).
    Every way ipyparallel reports an outcome is mapped here."""
    try:
        return Reply(rank, Status.OK, ar.get(timeout))
    except TimeoutError as e:
        return Reply(rank, Status.LATE, error=e)
    except Exception as e:  # noqa: BLE001 - what the task raised, or what ipyparallel did
        return Reply(rank, Status.DIED if engine_died(e) else Status.FAILED, error=e)


def replies(ranks: Sequence[int], ars: Sequence[Any], timeout: float) -> list[Reply]:
    """One :class:`Reply` per rank of ``ranks`` (its task in ``ars``), all within ``timeout``
    seconds together; late and failed ranks are replies too, never raised."""
    deadline = time.monotonic() + timeout
    return [
        reply(rank, ar, max(0.0, deadline - time.monotonic()))
        for rank, ar in zip(ranks, ars, strict=True)
    ]


def gather(
    ranks: Sequence[int],
    ars: Sequence[Any],
    timeout: float,
    *,
    late: Callable[[int], Exception],
    failed: Callable[[int, Exception], Exception] | None = None,
) -> list[Any]:
    """The results of ``ars`` (one task per rank of ``ranks``), all within ``timeout`` seconds
    together: a rank that is late is ``late(rank)`` raised, one whose task failed
    ``failed(rank, error)`` (or the error itself)."""
    deadline = time.monotonic() + timeout
    out = []
    for rank, ar in zip(ranks, ars, strict=True):
        got = reply(rank, ar, max(0.0, deadline - time.monotonic()))
        if got.status is Status.LATE:
            raise late(rank) from None
        if got.error is not None:
            if failed is None:
                raise got.error
            raise failed(rank, got.error) from None
        out.append(got.value)
    return out
