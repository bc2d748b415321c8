"""A local cluster: the controller and engines this kernel starts, on this machine, and stops.

The only module that touches ipyparallel's Cluster. The workers run in a private network
(:mod:`nbdist.kernel.netns`) where the platform allows it; every process is written to the run
record as it starts, so that the reaper (:mod:`nbdist.kernel.reaper`) stops them if the kernel
dies. Engines are ordered by engine id and a rank is a *position* in that order, never the id
itself: ids change when engines are replaced.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from nbdist.engine import backends, worker
from nbdist.engine.env import sigint_ignored
from nbdist.engine.hardware import (
    affinity_cpus,
    busy_gpus_notice,
    cpu_quota,
    cpus_within,
    gpu_holders,
    memory_room,
    usable_cpus,
    visible_gpus,
)
from nbdist.errors import ClusterError
from nbdist.kernel.connfile import quiet_late_replies
from nbdist.kernel.engines import EngineInfo, RankedEngines, exit_text
from nbdist.kernel.netns import PrivateNetwork, wait_for_files
from nbdist.kernel.oom import MemoryWatch
from nbdist.kernel.runfiles import (
    KEEP_LOGS_ENV,
    Reaper,
    clean_stale,
    keep_logs,
    kill_tree,
    run_dir,
    same_process,
    started,
)
from nbdist.protocol import EngineReport

log = logging.getLogger(__name__)

DEFAULT_CPU_WORKERS = 2
ENGINE_START_TIMEOUT_S = 120
ENGINE_OUTPUT_LINES = 8  # of an engine that exited while starting, quoted in the error
HEARTBEAT_MS = 500
CONNECTION_FILES_TIMEOUT_S = 30
ZOMBIE_WAIT_S = 5.0  # for a killed engine's last threads to exit (longer on a busy machine)
LOOPBACK = "127.0.0.1"
LOCAL_SOURCE = f"a local ipyparallel cluster ({LOOPBACK})"


def default_workers() -> int:
    """One worker per visible GPU; 2 on a CPU-only machine."""
    return len(visible_gpus()) or DEFAULT_CPU_WORKERS


class LocalCluster(RankedEngines):
    """A local ipyparallel cluster owned by this kernel, stopped when the kernel exits.

    ``notify`` receives the one-line notices a user should see (starting, resizing,
    replacing). A start is two steps, :meth:`launch` (the processes) and :meth:`attach` (the
    notebook's client, the engines ranked): a start in the background (:mod:`prestart`) runs
    the first on its thread and leaves the second to the notebook's.
    """

    source = LOCAL_SOURCE
    STARTS_ENGINES = True

    def __init__(self, *, notify: Callable[[str], None] = log.info) -> None:
        super().__init__(notify=notify)
        self._cluster: Any = None
        self._reaper: Reaper | None = None  # the run record, and the process that watches it
        self._procs: dict[int, float] = {}  # engine pid -> its start: a tree kill checks both
        self._memory = MemoryWatch()  # to tell the out-of-memory killer from a kill -9
        self._exit_codes: dict[int, int] = {}  # engine pid -> how it ended, once known
        self.network: PrivateNetwork | None = None
        # The workers' network: "private", "isolated" or "host" (%distrain start --network);
        # None: what $NBDIST_ENGINE_NETWORK says, else private.
        self.network_mode: str | None = None
        # CurveZMQ on every controller socket (benchmarks/curve_cost.py turns it off to compare).
        self.encrypt = True
        self.preload: str | None = None  # the framework new engines import as they start
        # Runs first in stop(): a background start (nbdist.kernel.prestart) stops and is waited.
        self.before_stop: Callable[[], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, n: int | None = None) -> None:
        """Start a controller on loopback and ``n`` engines, and learn what each can use."""
        if self.running:
            return
        n = n or default_workers()
        begun = time.perf_counter()
        self.launch(n)
        self.attach(n)
        log.info("cluster with %d engines up in %.1f s", n, time.perf_counter() - begun)

    def launch(
        self,
        n: int,
        *,
        cancel: threading.Event | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        """Start the controller and ``n`` engines (no client yet: :meth:`attach` makes it, in
        the thread that uses it; a client made in another thread lost the engines' printed
        output here). ``cancel`` (a background start's): once set, the start stops at its next
        step and stops what it started. ``notify`` replaces the cluster's own for its notices."""
        say = notify or self._notify

        def checkpoint() -> None:
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt

        for notice in (
            more_workers_than_gpus(n),
            more_workers_than_cpus(n),
            busy_gpus_notice(visible_gpus(), gpu_holders(), me=os.getpid()),
        ):
            if notice:
                say(notice)
        cleaned = clean_stale()
        if cleaned:
            say(
                f"nbdist: stopped {cleaned} leftover cluster process"
                f"{'es' if cleaned > 1 else ''} of a kernel that had crashed"
            )
        too_little_memory(n, self.preload)  # (what a crashed kernel left is freed now)
        folder = run_dir()
        try:
            self._reaper = Reaper(folder)
        except OSError as e:
            e.filename = e.filename or str(folder)  # a full disk fails a write: no file named
            raise _start_failed(n, e) from e
        self.network = PrivateNetwork(self._reaper.record.sockets)
        workers = f"{n} worker{'s' if n > 1 else ''}"
        say(f"nbdist: starting {workers} (local ipyparallel cluster on {LOOPBACK})")
        try:
            # The holder starts meanwhile; its namespace is awaited below.
            self.network.start(self.network_mode)
            self._record_pids()
            profile = self._reaper.record.profile
            profile.mkdir(mode=0o700)
            cluster = _ipp_cluster(n, encrypt=self.encrypt, network=self.network, profile=profile)
            self._cluster = cluster
            atexit.register(self.stop)  # the only exit handler: the cluster has shutdown_atexit off
            checkpoint()
            cluster.start_controller_sync()
            self._record_pids()
            self.network.ready()
            self._record_pids()
            self.network.link_out()
            self._record_pids()
            checkpoint()
            say(self.network.describe())
            cluster.config.LocalEngineSetLauncher.environment = _engine_env(
                self.preload, n, self.network
            )
            self.network.link(wait_for_files(cluster.controller, CONNECTION_FILES_TIMEOUT_S))
            checkpoint()
            cluster.start_engines_sync(n)
            self._record_pids()
            checkpoint()
        except BaseException as e:  # an interrupt too: no half-started cluster stays behind
            self.stop()
            if not isinstance(e, Exception):
                raise
            raise _start_failed(n, e) from e

    def attach(self, n: int) -> None:
        """The notebook's client, once the ``n`` engines :meth:`launch` started registered."""
        try:
            self._client = quiet_late_replies(self._cluster.connect_client_sync())
            self._learn_engines(self._new_ids(set(), n), timeout=ENGINE_START_TIMEOUT_S)
        except BaseException as e:
            self.stop()
            if not isinstance(e, Exception):
                raise
            raise _start_failed(n, e) from e

    def stop(self, note: str | None = "the workers were stopped") -> None:
        """Stop engines and controller; no process is left behind.

        An interrupt cannot cut it short (it takes about 2 s): a stop half done would leave
        processes that nothing stops any more.
        """
        if self.before_stop is not None:
            self.before_stop()
        with sigint_ignored():
            self._stop(note)

    def _stop(self, note: str | None = None) -> None:
        cluster, client = self._cluster, self._client
        procs = dict(self._procs)
        self._cluster = self._client = None
        atexit.unregister(self.stop)
        self._forget_engines(note)
        if client is not None:
            if cluster is not None and cluster.engines and procs:
                shutdown_engines(client, procs)
            try:
                client.close()
            except Exception:  # a closing client can only fail on its own sockets
                log.debug("client close failed", exc_info=True)
        if cluster is not None:
            cluster.stop_cluster_sync()
        if self._reaper is not None:
            _kill_nannies(self._reaper.record.profile)
        if self.network is not None:
            self.network.stop()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.stop()
            if keep_logs():
                self._notify(
                    f"nbdist: the cluster's logs are kept in {reaper.record.profile / 'log'} "
                    f"({KEEP_LOGS_ENV} is set)"
                )

    def restart(self, n: int | None = None) -> None:
        n = n or self.size or None
        self.stop(note="the workers were restarted")
        self.start(n)

    def ensure(self, n: int | None, *, note: str | None = None) -> None:
        """Have a cluster of ``n`` engines (keep the running one when ``n`` is None or equal);
        ``note``: what to tell of the variables a resize loses."""
        if not self.running:
            self.start(n)
        elif n is not None and n != self.size:
            too_little_memory(n, self.preload, room=self._room_without_engines())
            self._notify(f"nbdist: resizing the cluster from {self.size} to {n} workers")
            for notice in (more_workers_than_gpus(n), more_workers_than_cpus(n)):
                if notice:
                    self._notify(notice)
            self.replace_engines(n, note=note)

    def _room_without_engines(self) -> tuple[int, int] | None:
        """The memory limit and its use (:func:`memory_room`) as they will be once the running
        engines, which a resize replaces, are gone."""
        import psutil

        room = memory_room()
        if room is None:
            return None
        held = 0  # what each engine's exit frees: its own pages (USS), not shared libraries
        for e in self.engines:
            with contextlib.suppress(psutil.Error):
                held += psutil.Process(e.pid).memory_full_info().uss
        return room[0], max(0, room[1] - held)

    def replace_engines(
        self,
        n: int | None = None,
        *,
        notice: str | None = None,
        why: str | None = None,
        note: str | None = None,
    ) -> None:
        """Stop every engine and start ``n`` fresh ones under the same controller. ``notice`` is
        the line to show first ("nbdist: replacing the engines (``why``)" when only ``why`` the
        engines need it is given); ``note`` is what the session tells of the variables lost
        (None: the caller tells, in its error)."""
        if notice is None and why:
            notice = f"nbdist: replacing the engines ({why})"
        if notice:
            self._notify(notice)
        n = n or self.size
        old = set(self._client.ids)
        try:
            shutdown_engines(self._client, dict(self._procs))
            self._forget_engines(note)
            self._cluster.stop_engines_sync()
            self._record_pids()
            self._cluster.config.LocalEngineSetLauncher.environment = _engine_env(
                self.preload, n, self.network
            )
            self._cluster.start_engines_sync(n)
            self._record_pids()
            self._learn_engines(self._new_ids(old, n), timeout=ENGINE_START_TIMEOUT_S)
        except BaseException as e:
            # An interrupt, or engines that do not come back: no cluster rather than one with
            # fewer engines than its pidfile and its ranks say. The next cell starts a new one.
            self.stop(note=None)
            if not isinstance(e, Exception):
                raise
            raise ClusterError(
                f"the engines could not be replaced ({type(e).__name__}: {e}); the cluster was "
                "stopped, and the next %%distrain (or %distrain start) starts a new one."
            ) from e

    def replace_ranks(self, ranks: Sequence[int]) -> bool:
        """New engines for the dead ``ranks``, each at its rank (its host, GPU and local
        rank); the other engines, and their variables, stay (``nbdist.kernel.healing``).
        True: they were replaced (a local cluster always starts them)."""
        ranks = sorted(ranks)
        old = set(self._client.ids)
        for r in ranks:  # what is left of the dead (a zombie's threads, its loaders)
            pid = self.engines[r].pid
            kill_tree((pid, self._procs.get(pid, 0.0)))
        # ipyparallel drops a dead engine's launcher only when its loop next runs: a launcher of
        # an engine that died (this one, or an earlier one) is not a new engine that failed.
        started = [launcher.pid for launcher in self._launchers()]
        self._cluster.config.LocalEngineSetLauncher.environment = _engine_env(
            self.preload, self.size, self.network
        )
        self._cluster.start_engines_sync(len(ranks))
        self._record_pids()
        ids = self._new_ids(old, len(ranks), started=started)
        infos = (
            self._client[ids]
            .apply_async(worker.engine_info, self._peer())
            .get(timeout=ENGINE_START_TIMEOUT_S)
        )
        engines = list(self.engines)
        for r, engine_id, info in zip(ranks, ids, infos, strict=True):
            engines[r] = replace(engines[r], engine_id=engine_id, pid=info.pid)
        self._pin_gpus([engines[r] for r in ranks])
        self._learned(engines)
        return True

    def lose(self, ranks: Sequence[int], hosts: Sequence[str]) -> str:
        """The engines of ``ranks`` died, or had to be killed, during a job: every engine is
        replaced, so the next cell starts clean (the job's error tells what was lost)."""
        which = f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
        self.replace_engines(why=f"{which} had to be killed or died")
        return "replaced"

    def replace_dead(self, ranks: Sequence[int], gone: str) -> None:
        """Engines that died between cells (``gone`` says which and how): all are replaced."""
        self.replace_engines(
            notice=f"nbdist: {gone}; replacing the engines", why=gone,
            note="the workers were replaced",
        )  # fmt: skip

    def newcomers(self) -> list[int]:
        return []  # every engine of a local cluster is started, and ranked, by nbdist

    def take_newcomers(self) -> None:
        pass

    # -- the processes ---------------------------------------------------------------------------
    def kill(self, ranks: Sequence[int]) -> bool:
        """SIGKILL the engines of ``ranks`` and what they started (loaders, shells)."""
        for r in ranks:
            pid = self.engines[r].pid
            kill_tree((pid, self._procs.get(pid, 0.0)))
        return True

    def dead(self, ranks: Sequence[int]) -> list[int]:
        """Which of ``ranks`` have an engine process that is gone (or a zombie)."""
        return [
            r
            for r in ranks
            if not same_process((self.engines[r].pid, self._procs.get(self.engines[r].pid, 0.0)))
        ]

    def cpu_seconds(self, ranks: Sequence[int]) -> dict[int, float] | None:
        seconds = {r: cpu_seconds(self.engines[r].pid) for r in ranks}
        return {r: t for r, t in seconds.items() if t is not None}

    def exit_status(self, rank: int) -> int | None:
        """How the engine of ``rank`` ended: its exit code (negative: the signal that killed
        it); None while it runs.

        ipyparallel's watcher thread reaps the engine; this method only looks (``_ended``),
        and a dead engine's code is looked for until it appears, for up to ``ZOMBIE_WAIT_S``
        (while a killed engine is a zombie whose other threads still exit, or the watcher is
        about to keep the code).
        """
        if self._cluster is None or rank >= self.size:
            return None
        pid = self.engines[rank].pid
        if pid in self._exit_codes:
            return self._exit_codes[pid]
        deadline = time.monotonic() + ZOMBIE_WAIT_S
        while True:
            code, running = self._exit_code(pid)
            if code is not None:
                # Kept: the watcher's launcher, which holds the code, is dropped when the
                # cluster's loop next runs (a later start of engines).
                self._exit_codes[pid] = code
            if code is not None or running or time.monotonic() > deadline:
                return code
            time.sleep(0.05)

    def how_ended(self, rank: int) -> str:
        code = self.exit_status(rank)
        if code == -signal.SIGKILL:
            cause = self._memory.cause(self.engines[rank].pid)
            if cause:
                return (
                    f"killed by SIGKILL from {cause}. Use less memory on each rank (a smaller "
                    "batch or model), or fewer ranks, or give the job more memory"
                )
        return exit_text(code)

    def note_memory(self) -> None:
        self._memory.note(e.pid for e in self.engines)

    def _exit_code(self, pid: int) -> tuple[int | None, bool]:
        """(the exit code of engine ``pid`` if known, whether it still runs)."""
        import psutil

        for engine_set in self._cluster.engines.values():
            # Once ipyparallel's own watcher has seen the engine exit, it keeps the exit code
            # here and drops the launcher.
            for data in (engine_set.stop_data or {}).get("engines", {}).values():
                if data.get("pid") == pid and data.get("exit_code") is not None:
                    return data["exit_code"], False
            for launcher in list(engine_set.launchers.values()):
                if launcher.pid == pid and launcher.process is not None:
                    code, ended = _ended(launcher)
                    if ended:
                        return code, False
        try:
            # A killed engine's main thread shows as a zombie while its other threads still
            # exit; it cannot be reaped until they have.
            return None, psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return None, False

    def status_notes(self) -> list[str]:
        return [self.network.details()] if self.network is not None else []

    def network_now(self) -> str | None:
        """The network the running workers have: "private", "isolated" or "host" (None: no
        local cluster runs)."""
        if not self.running or self.network is None:
            return None
        if not self.network.private:
            return "host"
        return "isolated" if self.network.isolated else "private"

    def tf_exposure(self) -> str | None:
        """Who could reach a multi-worker TensorFlow job's servers: nobody outside the workers
        in a private network, else anyone who reaches this machine."""
        if self.network is None or self.network.private:
            return None
        return f"anyone who can reach this machine ({self.network.reason})"

    def describe_lost(self, where: str, count: int, hosts: Sequence[str]) -> str | None:
        return None  # a local engine that ended died: the job says how

    # -- internals -------------------------------------------------------------------------------
    def _peer(self) -> str:
        return LOOPBACK

    def _settle(self, infos: list[EngineReport]) -> list[EngineReport]:
        from dataclasses import replace

        return [replace(info, address=LOOPBACK) for info in infos]

    def _learned(self, engines: list[EngineInfo]) -> None:
        self._procs = {e.pid: started(e.pid) or 0.0 for e in engines}
        for e in engines:  # a new engine may have an old one's PID
            self._exit_codes.pop(e.pid, None)
        self.engines = engines
        self.note_memory()
        self._record_pids()

    def _record_pids(self) -> None:
        """Write every process of this cluster that exists now to the run record: the reaper
        can then clean up after a kernel killed at any point of a start or a replacement."""
        if self._reaper is None:
            return
        network = self.network
        around = (network.holder, network.outbound) if network is not None else ()
        pids = [p.pid for p in around if p is not None]
        cluster = self._cluster
        if cluster is not None:
            if cluster.controller is not None:
                pids.append(cluster.controller.pid)
            pids += [launcher.pid for launcher in self._launchers()]
        pids += [e.pid for e in self.engines]
        self._reaper.record.write(dict.fromkeys(pids))
        _private_logs(self._reaper.record.profile / "log")

    def _new_ids(self, old: set[int], n: int, *, started: Sequence[int] = ()) -> list[int]:
        """The ids of ``n`` engines registered after ``old`` (``started``: the launchers' pids
        from before these engines were started: not theirs, whatever became of them)."""
        return self._registered(
            old, n, ENGINE_START_TIMEOUT_S, exited=lambda: self._exited_engine(started)
        )

    def _exited_engine(self, started: Sequence[int] = ()) -> str | None:
        """An engine process of this cluster that exited while the others start, and the end
        of what it printed (its own error: it could not join the private network, a module in
        the notebook's folder broke its imports, ...); None while they all run."""
        for launcher in self._launchers():
            if getattr(launcher, "process", None) is None or launcher.pid in started:
                continue
            code, ended = _ended(launcher)
            if not ended:
                continue
            lines = [ln for ln in launcher.get_output().splitlines() if ln.strip()]
            said = "\n".join(f"    {ln}" for ln in lines[-ENGINE_OUTPUT_LINES:])
            return (
                f"an engine exited while starting ({exit_text(code)}); it said:\n"
                f"{said or '    (nothing)'}\n"
            )
        return None

    def _launchers(self) -> list[Any]:
        """ipyparallel's launcher of each engine process it still lists, of every engine set."""
        if self._cluster is None:
            return []
        return [
            launcher
            for engine_set in self._cluster.engines.values()
            for launcher in list(engine_set.launchers.values())
        ]


def _ended(launcher: Any) -> tuple[int | None, bool]:
    """(the exit code of the process of ipyparallel's ``launcher``, if known; whether it has
    ended), without reaping it.

    ipyparallel's watcher thread reaps it. A second wait here would race that one: whoever
    reaps first has the code, and psutil's ``Process.wait`` caches the other's None over it
    (10 of 300 kills at the moment the engine became a zombie, here), so that nobody knew how
    the engine ended (a CI run: "dead", without its cause). A zombie is only looked at
    (``WNOWAIT``); once it is reaped, the code is the watcher's, read when its thread is done.
    """
    try:
        info = os.waitid(os.P_PID, launcher.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped (by the watcher), or not this process's child
        watcher = getattr(launcher, "_wait_thread", None)
        if watcher is not None and watcher.is_alive():
            return None, False  # it is about to keep the code
        import psutil

        try:  # the watcher's own psutil Process, which keeps the code it reaped
            return launcher.process.wait(0), True
        except psutil.TimeoutExpired:
            return None, False
    if info is None:  # it runs (or its last threads still exit)
        return None, False
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return -info.si_status, True
    return info.si_status, True


def engine_nannies(profile: Any) -> list[Any]:
    """ipyparallel's nannies of the engines of the cluster with this profile folder (psutil
    processes, known by the folder in their environment), wherever they are now: an engine
    starts its nanny in a session of its own, so an orphaned one is nobody's child."""
    import psutil

    want, out = str(profile), []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "ipyparallel.engine.nanny" not in " ".join(proc.info["cmdline"] or ()):
                continue
            if proc.environ().get("IPP_PROFILE_DIR") == want:
                out.append(proc)
    return out


def _kill_nannies(profile: Any) -> None:
    """SIGKILL the nannies of this cluster's engines. Once the engine has gone with the
    controller, a nanny can wait forever to tell the gone controller so: two were found 16
    minutes after a start that failed."""
    import psutil

    for proc in engine_nannies(profile):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def shutdown_engines(client: Any, procs: dict[int, float]) -> None:
    """Ask engines to exit, then SIGKILL any still there after a second (``procs``: each
    engine's pid and start, so that nothing else is killed).

    Engines that ran a gloo or TF collective often ignore SIGTERM, and the launcher would
    wait for each in turn; a shutdown request followed by SIGKILL takes one second at most.
    """
    import psutil

    try:
        client.shutdown(targets="all", hub=False, block=False)
    except Exception:  # engines already gone: nothing to ask
        log.debug("engine shutdown request failed", exc_info=True)
    alive = []
    for pid, start in procs.items():
        if same_process((pid, start)):
            with contextlib.suppress(psutil.NoSuchProcess):
                alive.append(psutil.Process(pid))
    _, left = psutil.wait_procs(alive, timeout=1)
    for proc in left:
        kill_tree((proc.pid, procs[proc.pid]))


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


def _ipp_cluster(n: int, *, encrypt: bool, network: Any, profile: Any) -> Any:
    """The ipyparallel Cluster nbdist starts: nbdist's engine command, a fast heartbeat,
    CurveZMQ, the controller's sockets where the private network wants them."""
    import ipyparallel as ipp
    from traitlets.config import Config

    config = Config()
    config.LocalControllerLauncher.environment = _signing_key()
    # Engines that ran a collective may ignore SIGTERM: don't wait 5 s before SIGKILL.
    config.LocalProcessLauncher.stop_seconds_until_kill = 1
    config.LocalEngineSetLauncher.engine_cmd = engine_command()
    return ipp.Cluster(
        n=n,
        # The hub registers an engine at its first heartbeat: with the default 3 s period,
        # engines wait ~4 s idle before they are usable. 0.5 s brings a cold start from ~7 s
        # to ~3 s; 20 misses: a silent engine counts as dead after 10 s.
        controller_args=[
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={10_000 // HEARTBEAT_MS}",
            # Every message between kernel, controller and engines encrypted.
            f"--IPController.enable_curve={encrypt}",
            *network.controller_args(),
        ],
        # WARNING would print every replaced engine's whole log into the cell.
        log_level=logging.ERROR,
        config=config,
        load_profile=False,
        # Its own profile folder in nbdist's private run folder (not ~/.ipython's, 0755): the
        # connection files and the logs, which hold the engines' raw output.
        profile_dir=str(profile),
        # LocalCluster.stop (atexit) stops it, the reaper if the kernel dies. ipyparallel's own
        # exit handler would run first when its first controller starts after our stop was
        # registered, and stop it from under a background start still running: the controller
        # stayed behind (kernel shut down 1 s after %load_ext).
        shutdown_atexit=False,
    )


def _signing_key() -> dict[str, str]:
    """A message-signing key of the cluster's own, for the controller's environment (a
    process's environment is readable by its user only; a command line is not).

    With CurveZMQ on, ipyparallel drops the digest key unless one is given, and every client
    and engine then warns "Message signing is disabled. This is insecure". CurveZMQ
    authenticates and encrypts; the key signs each message as well, as Jupyter's kernels do.
    The controller writes it into the connection files (in the private profile folder), from
    which the engines and the notebook's client take it."""
    import secrets

    return {"IPP_SESSION_KEY": secrets.token_hex(32)}


def engine_command() -> list[str]:
    """How a local engine is started: ``nbdist.engine.boot`` without the notebook's folder in
    front of ``sys.path``.

    Engines start in the notebook's folder, and ``python -m`` (or ``-c``) puts that folder
    first on ``sys.path``: a ``profile.py`` there (a file a person may well have) hid the
    standard library's, and the engines died importing IPython. The boot puts the folder back
    at the end, so the notebook's own modules still import (``%%writefile mymod.py``, then
    ``import mymod`` in a cell). Python 3.11 has ``-P`` for this; 3.10 does not.
    """
    return [
        sys.executable,
        "-c",
        "import sys; sys.path.pop(0); from nbdist.engine.boot import main; main()",
    ]


def _private_logs(folder: Any) -> None:
    """The logs ipyparallel's launchers open (with the process's umask, 0644 as a rule) made
    readable by this user only, in a folder only this user can enter."""
    if not folder.is_dir():
        return
    folder.chmod(0o700)
    for log_file in folder.iterdir():
        with contextlib.suppress(OSError):
            if log_file.is_file() and not log_file.is_symlink():
                log_file.chmod(0o600)


def _engine_env(preload: str | None, n: int, network: Any) -> dict[str, str]:
    """The environment new engines start with."""
    # Only a framework whose import starts no thread and touches no device (torch's; not
    # TensorFlow's, imported by the warm-up call after the engine registered).
    wanted = preload is not None and backends.load(preload).PRELOAD_AT_START
    env = {"NBDIST_PRELOAD": preload if preload is not None and wanted else ""}
    if network is not None:
        env.update(network.engine_env())
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: OpenMP pools sized before the framework starts. Setting torch's
        # threads later is not enough; measured here, 2 workers' steps were ~6% slower.
        env["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // n))
    return env


def _start_failed(n: int, e: BaseException) -> ClusterError:
    """The start's error, with the advice that fits its cause."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" ({e.filename})" if e.filename else ""
        return ClusterError(
            f"could not start {n} local engines: no space left on the disk that holds nbdist's "
            f"run files{where}. Free some space there, or set XDG_RUNTIME_DIR to a folder on "
            "another disk, then run %distrain start again."
        )
    cause = str(e)
    if cause.startswith("the ipyparallel controller"):
        advice = (
            "Check that ipyparallel is installed in this kernel's environment, then run "
            "%distrain start again."
        )
    elif cause.startswith("an engine exited while starting"):
        return ClusterError(
            f"could not start {n} local engines: {cause.rstrip()}\nThat is the engine's own "
            "error: fix what it names, then run %distrain start again (--network host starts "
            "the workers on this machine's network, without the private one)."
        )
    elif "new engines registered within" in cause and n > 1:
        advice = (
            "A busy machine may not start them in time: run %distrain start again, or with "
            f"fewer workers (%distrain start -n {n // 2})."
        )
    else:
        advice = "Run %distrain start again."
    return ClusterError(f"could not start {n} local engines: {cause}. {advice}")


def too_little_memory(n: int, framework: str | None, room: tuple[int, int] | None = None) -> None:
    """A ClusterError, before anything starts, when the memory limit of this kernel's cgroup (a
    JupyterHub's ``mem_limit``) leaves less than ``n`` workers of ``framework`` (the first
    installed one when not known yet) need at the least: an out-of-memory kill mid-start, or at
    the first cell, would say less. ``room``: (limit, in use) in bytes, else read."""
    room = room if room is not None else memory_room()
    if room is None:
        return
    framework = framework or backends.first_installed()
    if framework is None:
        return
    backend = backends.load(framework)
    engine_mb = getattr(backend, "ENGINE_MB", None)  # (a registered backend may not say)
    if not engine_mb:
        return
    limit, used = room
    free, each = max(0, limit - used), engine_mb * 2**20
    if n * each <= free:
        return
    fits = free // each
    fewer = f"fewer workers (-n {fits})" if fits else "no worker fits"
    raise ClusterError(
        f"{n} workers need about {_size(n * each)} of memory ({engine_mb} MB each: an "
        f"engine after a first small {backend.TITLE} cell, as measured on nbdist's test machine; "
        f"training needs more), and this kernel's memory limit leaves {_size(free)} (its cgroup "
        f"allows {_size(limit)}, {_size(used)} in use): {fewer}. Ask for more memory (a "
        "JupyterHub's mem_limit), or close other notebooks' kernels."
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MB"


def more_workers_than_cpus(n: int, *, total: int | None = None) -> str | None:
    """The notice for ``n`` CPU workers on fewer CPUs than that, where this kernel may use
    fewer than the machine has (a JupyterHub's ``cpu_limit``, a container's ``--cpus``, an
    affinity mask); ``total``: the machine's count."""
    gpus = len(visible_gpus())
    if gpus and n <= gpus:
        return None  # one GPU each
    affinity, quota = affinity_cpus(), cpu_quota()
    cpus, machine = cpus_within(affinity, quota), total or os.cpu_count() or 1
    if n <= cpus or cpus >= machine:
        return None
    why = (
        f"its cgroup's CPU quota is {quota:g} CPU{'s' if quota != 1 else ''}"
        if quota is not None and int(quota) < affinity
        else "its CPU affinity"
    )
    return (
        f"nbdist: {n} workers on the {cpus} CPU{'s' if cpus > 1 else ''} this kernel may use of "
        f"the machine's {machine} ({why}): they take turns, and every step waits for the "
        f"slowest; -n {cpus} gives each worker a CPU of its own."
    )


def more_workers_than_gpus(n: int) -> str | None:
    """The notice for ``n`` local workers on fewer GPUs than that: they run on the CPU."""
    gpus = len(visible_gpus())
    if not gpus or n <= gpus:
        return None
    some, where = (f"{gpus} GPUs", "one on each GPU") if gpus > 1 else ("1 GPU", "one on the GPU")
    return (
        f"nbdist: {n} workers for {some}: the workers use the CPU (gloo), since with nccl each "
        f"needs a GPU of its own; -n {gpus} puts {where}."
    )
