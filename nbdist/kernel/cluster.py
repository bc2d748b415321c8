"""The engines jobs run on. The only module that touches ipyparallel's Cluster and Client.

nbdist starts a local cluster (controller on loopback) on first use and keeps it across cells.
Engines are ordered by engine id and a rank is a *position* in that order, never the id itself:
ids change when engines are replaced.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbdist.engine import worker
from nbdist.engine.env import sigint_ignored
from nbdist.engine.hardware import (
    busy_gpus_notice,
    gpu_holders,
    usable_cpus,
    visible_gpus,
)
from nbdist.errors import ClusterError
from nbdist.kernel.engines import (
    EngineInfo,
    RankedEngines,
    rank_engines,
    settle_addresses,
    shutdown_engines,
)
from nbdist.kernel.netns import PrivateNetwork, wait_for_files
from nbdist.kernel.runfiles import Reaper, clean_stale, run_dir

log = logging.getLogger(__name__)

DEFAULT_CPU_WORKERS = 2
ENGINE_START_TIMEOUT_S = 120
HEARTBEAT_MS = 500
CONNECTION_FILES_TIMEOUT_S = 30
LOOPBACK = "127.0.0.1"
LOCAL_SOURCE = f"a local ipyparallel cluster ({LOOPBACK})"


def default_workers() -> int:
    """One worker per visible GPU; 2 on a CPU-only machine."""
    return len(visible_gpus()) or DEFAULT_CPU_WORKERS


@dataclass
class Rendezvous:
    """A framework's live rendezvous on the current engines: the key it was made for and envs."""

    key: tuple[Any, ...]
    envs: list[dict[str, str]] = field(default_factory=list)


class LocalCluster(RankedEngines):
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
        self._reaper: Reaper | None = None  # the run record, and the process that watches it
        self.network: PrivateNetwork | None = None
        self.engines: list[EngineInfo] = []
        self.warm: set[str] = set()
        self.rendezvous: dict[str, Rendezvous] = {}
        # The framework new engines import before they register (see nbdist.engine.boot).
        self.preload: str | None = None
        # False for a cluster started elsewhere (%distrain connect): nbdist never stops it.
        self.owned = True
        self.source = LOCAL_SOURCE
        self.stale: str | None = None  # why a connected cluster cannot run jobs any more
        self.exposure_told = False  # --expose-tf's notice shown for this cluster
        # CurveZMQ on every controller socket (benchmarks/curve_cost.py turns it off to compare).
        self.curve = True
        # A start begun at %load_ext (start_in_background): what it would have said, and how it
        # ended, held for the first command that needs the cluster.
        self._thread: threading.Thread | None = None
        self._cancel: threading.Event | None = None  # set: that background start stops
        self._done: threading.Event | None = None  # set: that background start has ended
        self._held: list[str] = []
        self._shown_notify: Callable[[str], None] | None = None
        self._background_error: BaseException | None = None
        self._unconnected: int | None = None  # engines started in the background, no client yet

    @property
    def running(self) -> bool:
        self._wait_background()
        return self._client is not None

    # -- lifecycle -------------------------------------------------------------------------------
    def start_in_background(self, n: int | None = None) -> None:
        """Begin :meth:`start` on a thread and return at once (``%load_ext nbdist``: the user
        reads and types meanwhile).

        Its notices are held, and its error too, for the first command that needs the cluster:
        every other method waits for the start first (a Ctrl-C while waiting cancels it and
        leaves no cluster, or the whole one if it had just finished). A kernel that exits
        meanwhile stops what has started.
        """
        if self._thread is not None or self._client is not None:
            return
        # Its own cancel flag, read by that thread only: a start in the notebook's thread
        # after it never sees a cancel meant for it.
        self._cancel, self._done = threading.Event(), threading.Event()
        self._held, self._background_error = [], None
        self._shown_notify, self._notify = self._notify, self._held.append
        self._thread = threading.Thread(
            target=self._start_held,
            args=(n, self._cancel, self._done),
            name="nbdist-prestart",
            daemon=True,
        )
        atexit.register(self.stop)
        try:
            self._thread.start()
        except BaseException:  # no thread (can't start new thread): nothing runs, nothing waits
            self._notify = self._shown_notify or self._notify
            self._thread, self._cancel, self._done, self._shown_notify = None, None, None, None
            atexit.unregister(self.stop)
            raise

    def _start_held(self, n: int | None, cancel: threading.Event, done: threading.Event) -> None:
        try:
            self.start(n, connect=False, cancel=cancel)
        except BaseException as e:  # noqa: B036 - held for the first command, raised there
            self._background_error = e
        finally:
            done.set()

    def _wait_background(self, *, connect: bool = True) -> None:
        """Wait for a background start to end; show what it said (in the cell that waits), and
        connect the notebook's client to its engines (``connect``).

        It waits on the start's own ``done`` event, never in ``Thread.join`` or ``is_alive``:
        a Ctrl-C that interrupts those (CPython 3.11) releases the thread's state lock and marks
        it stopped while it still runs, and the start then ended after the cell had moved on.
        """
        thread, done = self._thread, self._done
        if thread is None or done is None or thread is threading.current_thread():
            return
        try:
            while not done.is_set():
                time.sleep(0.05)
        except KeyboardInterrupt:
            self._cancel_background()  # it stops at its next step and stops what it started
            with sigint_ignored():
                done.wait()
                self._end_background(show=False)
                if self._unconnected is not None:  # launched before it saw the cancel
                    self._unconnected = None
                    self._stop()
            raise
        self._end_background(show=True)
        n, self._unconnected = self._unconnected, None
        if connect and n is not None and self._background_error is None:
            try:
                self._connect_engines(n)
            except ClusterError as e:
                self._background_error = e

    def _cancel_background(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def _end_background(self, *, show: bool) -> None:
        self._thread, self._cancel, self._done = None, None, None
        self._notify, self._shown_notify = self._shown_notify or self._notify, None
        held, self._held = self._held, []
        error, self._background_error = self._background_error, None
        if isinstance(error, KeyboardInterrupt):  # cancelled: stopped already, nothing to say
            return
        if show:
            for message in held:
                self._notify(message)
        if error is not None:
            self._background_error = error  # for raise_background_error, once

    @property
    def background_error(self) -> BaseException | None:
        """Why the background start failed (None if it did not, or was never begun)."""
        self._wait_background()
        return self._background_error

    def raise_background_error(self) -> None:
        """The error of a background start that failed, once (then a plain start works)."""
        error = self.background_error
        self._background_error = None
        if error is not None:
            raise error

    def start(
        self, n: int | None = None, *, connect: bool = True, cancel: threading.Event | None = None
    ) -> None:
        """Start a controller on loopback and ``n`` engines, and learn what each can use.

        Without ``connect`` (a background start), stop once the engines are launched: the
        notebook's client is made in the thread that uses it (``_connect_engines``), as a client
        made in another thread lost the engines' printed output here. ``cancel`` (a background
        start's): once set, the start stops at its next step, and stops what it started.
        """

        def checkpoint() -> None:
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt

        if self.running:
            return
        self._background_error = None  # a failed background start: this one tries again
        self.owned, self.source = True, LOCAL_SOURCE
        self.stale, self.exposure_told = None, False
        n = n or default_workers()
        _check_gpus(n)
        busy = busy_gpus_notice(visible_gpus(), gpu_holders(), me=os.getpid())
        if busy:
            self._notify(busy)
        cleaned = clean_stale()
        if cleaned:
            self._notify(
                f"nbdist: stopped {cleaned} leftover cluster process"
                f"{'es' if cleaned > 1 else ''} of a kernel that had crashed"
            )
        folder = run_dir()
        self._reaper = Reaper(folder)
        self.network = PrivateNetwork(self._reaper.record.sockets)
        start = time.perf_counter()
        workers = f"{n} worker{'s' if n > 1 else ''}"
        self._notify(f"nbdist: starting {workers} (local ipyparallel cluster on {LOOPBACK})")
        try:
            self.network.start()  # the holder starts meanwhile; its namespace is awaited below
            self._record_pids()
            cluster = _ipp_cluster(n, curve=self.curve, network=self.network)
            self._cluster = cluster
            atexit.register(self.stop)  # the only exit handler: the cluster has shutdown_atexit off
            checkpoint()
            cluster.start_controller_sync()
            self._record_pids()
            self.network.ready()
            self._record_pids()
            checkpoint()
            if not self.network.private:
                self._notify(
                    f"nbdist: the workers share this machine's network ({self.network.reason}); "
                    "multi-worker TensorFlow jobs will need --expose-tf"
                )
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
        if not connect:
            self._unconnected = n
            return
        self._connect_engines(n)
        log.info("cluster with %d engines up in %.1f s", n, time.perf_counter() - start)

    def _connect_engines(self, n: int) -> None:
        try:
            self._client = self._cluster.connect_client_sync()
            self._learn_engines(self._new_ids(set(), n), timeout=ENGINE_START_TIMEOUT_S)
        except BaseException as e:
            self.stop()
            if not isinstance(e, Exception):
                raise
            raise _start_failed(n, e) from e

    def stop(self) -> None:
        """Stop engines and controller; no process is left behind. A connected cluster (one
        nbdist did not start) is only disconnected from: its engines keep running.

        An interrupt cannot cut it short (it takes about 2 s): a stop half done would leave
        processes that nothing stops any more.
        """
        self._cancel_background()  # a background start still running stops at its next step
        self._wait_background(connect=False)
        self._background_error = self._unconnected = None
        with sigint_ignored():
            self._stop()

    def _stop(self) -> None:
        if not self.owned:
            client, self._client, self._cluster = self._client, None, None
            self._forget_engines()
            if client is not None:
                client.close()
            self.owned, self.stale = True, None
            return
        cluster, client = self._cluster, self._client
        pids = [e.pid for e in self.engines]
        self._cluster = self._client = None
        atexit.unregister(self.stop)
        self._forget_engines()
        if client is not None:
            if cluster is not None and cluster.engines and pids:
                shutdown_engines(client, pids)
            try:
                client.close()
            except Exception:  # a closing client can only fail on its own sockets
                log.debug("client close failed", exc_info=True)
        if cluster is not None:
            cluster.stop_cluster_sync()
        if self.network is not None:
            self.network.stop()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.stop()

    def _record_pids(self) -> None:
        """Write every process of this cluster that exists now to the run record: the reaper
        can then clean up after a kernel killed at any point of a start or a replacement."""
        if self._reaper is None:
            return
        network = self.network
        pids = [network.holder.pid if network is not None and network.holder else None]
        cluster = self._cluster
        if cluster is not None:
            if cluster.controller is not None:
                pids.append(cluster.controller.pid)
            for engine_set in cluster.engines.values():
                pids += [launcher.pid for launcher in engine_set.launchers.values()]
        pids += [e.pid for e in self.engines]
        self._reaper.record.write(dict.fromkeys(pids))

    def connect(
        self,
        *,
        profile: str | None = None,
        cluster_id: str | None = None,
        profile_dir: str | None = None,
        url_file: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Attach to an ipyparallel cluster started elsewhere (``ipcluster start`` with any
        launcher, or a controller and engines started by hand); its engines become the workers.
        """
        from nbdist.kernel.connfile import open_client

        client, where = open_client(
            profile=profile, cluster_id=cluster_id, profile_dir=profile_dir, url_file=url_file,
            timeout=timeout, before=self._leave_for_another,
        )  # fmt: skip
        self._client, self._cluster = client, None
        self.owned, self.source = False, f"a connected ipyparallel cluster ({where})"
        self.stale, self.exposure_told = None, False
        self._forget_engines()
        try:
            self._learn_engines(timeout=timeout)
        except BaseException as e:  # an interrupt too: leave no half-connected state behind
            self._client, self.owned, self.stale = None, True, None
            self._forget_engines()
            client.close()
            if not isinstance(e, Exception):
                raise
            raise ClusterError(
                f"connected to {where}, but its engines did not answer within {timeout:.0f} s "
                f"({type(e).__name__}: {e}). Are they busy, or is nbdist missing from their "
                "Python environment (pip install nbdist there)?"
            ) from None

    def _leave_for_another(self) -> None:
        if self.running:
            self._notify("nbdist: leaving the current cluster for the one to connect to")
            self.stop()

    def _not_ours(self, why: str | None = None) -> str:
        return (
            f"the workers need a restart{f' ({why})' if why else ''}, and nbdist does not "
            f"start or stop the engines of {self.source}. Restart them where they were started "
            "(e.g. ipcluster stop / ipcluster start --profile NAME), then %distrain connect again."
        )

    def restart(self, n: int | None = None) -> None:
        self._wait_background()
        if not self.owned:
            raise ClusterError(self._not_ours())
        n = n or self.size or None
        self.stop()
        self.start(n)

    def ensure(self, n: int | None) -> None:
        """Have a cluster of ``n`` engines (keep the running one when ``n`` is None or equal)."""
        self.raise_background_error()
        if not self.running:
            self.start(n)
        elif not self.owned:
            if self.stale:
                raise ClusterError(self.stale)
            if n is not None and n > self.size:
                from IPython.core.error import UsageError

                raise UsageError(
                    f"%%distrain: -n {n}, but the connected cluster has {self.size} engines. "
                    f"Use -n {self.size} or fewer, or add engines with ipcluster engines."
                )
        elif n is not None and n != self.size:
            _check_gpus(n)  # before the notice: a resize that cannot happen is not announced
            self._notify(f"nbdist: resizing the cluster from {self.size} to {n} workers")
            self.replace_engines(n)

    def replace_engines(
        self, n: int | None = None, *, notice: str | None = None, why: str | None = None
    ) -> None:
        """Stop every engine and start ``n`` fresh ones under the same controller. ``notice`` is
        the line to show first ("nbdist: replacing the engines (``why``)" when only ``why`` the
        engines need it is given); a connected cluster is not ours to restart and says so
        instead, with ``why``."""
        if not self.owned:
            # Not ours to restart: say so now, and refuse further runs until reconnected (the
            # caller is reporting the failure that made the restart necessary).
            self.stale = self._not_ours(why)
            self._notify(f"nbdist: {self.stale}")
            return
        if notice is None and why:
            notice = f"nbdist: replacing the engines ({why})"
        if notice:
            self._notify(notice)
        n = n or self.size
        _check_gpus(n)
        old = set(self._client.ids)
        try:
            shutdown_engines(self._client, [e.pid for e in self.engines])
            self._forget_engines()
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
            self.stop()
            if not isinstance(e, Exception):
                raise
            raise ClusterError(
                f"the engines could not be replaced ({type(e).__name__}: {e}); the cluster was "
                "stopped, and the next %%distrain (or %distrain start) starts a new one."
            ) from e

    def _new_ids(self, old: set[int], n: int) -> list[int]:
        """The ids of ``n`` engines registered after ``old``, once all are there.

        A killed engine stays listed for up to the heartbeat's 10 s: counting every id would let
        a dead one plus a new one pass for two engines.
        """
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while True:
            new = sorted(set(self._client.ids) - old)
            if len(new) >= n:
                return new[:n]
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(new)} of {n} new engines registered within "
                    f"{ENGINE_START_TIMEOUT_S} s"
                )
            time.sleep(0.05)

    def _forget_engines(self) -> None:
        self.engines = []
        self.warm = set()
        self.rendezvous = {}

    def _learn_engines(self, ids: list[int] | None = None, *, timeout: float | None = None) -> None:
        ids = sorted(self._client.ids) if ids is None else ids
        peer = LOOPBACK if self.owned else self._controller_host()
        infos = self._client[ids].apply_async(worker.engine_info, peer).get(timeout=timeout)
        engines = rank_engines(ids, settle_addresses(infos, local=LOOPBACK if self.owned else None))
        ids = [e.engine_id for e in engines]
        self._client[ids].map_sync(worker.pin_gpu, [e.gpu for e in engines])
        if not self.owned:
            self._client[ids].map_sync(worker.set_address, [e.address for e in engines])
        self.engines = engines
        if self.owned:
            self._record_pids()

    def _controller_host(self) -> str:
        """The controller's address as the client reached it: engines find the interface they
        use towards it (see ``hardware.reachable_address``)."""
        from urllib.parse import urlparse

        # ipyparallel keeps the connection file's content, the interface made concrete, here.
        return urlparse(self._client._config["interface"]).hostname or LOOPBACK


def _ipp_cluster(n: int, *, curve: bool, network: Any) -> Any:
    """The ipyparallel Cluster nbdist starts: nbdist's engine command, a fast heartbeat,
    CurveZMQ, the controller's sockets where the private network wants them."""
    import ipyparallel as ipp
    from traitlets.config import Config

    config = Config()
    # Engines that ran a collective may ignore SIGTERM: don't wait 5 s before SIGKILL.
    config.LocalProcessLauncher.stop_seconds_until_kill = 1
    config.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-m", "nbdist.engine.boot"]
    return ipp.Cluster(
        n=n,
        # The hub registers an engine at its first heartbeat: with the default 3 s period,
        # engines wait ~4 s idle before they are usable. 0.5 s brings a cold start from ~7 s
        # to ~3 s; 20 misses: a silent engine counts as dead after 10 s.
        controller_args=[
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={10_000 // HEARTBEAT_MS}",
            # Every message between kernel, controller and engines encrypted.
            f"--IPController.enable_curve={curve}",
            *network.controller_args(),
        ],
        # WARNING would print every replaced engine's whole log into the cell.
        log_level=logging.ERROR,
        config=config,
        load_profile=False,
        # LocalCluster.stop (atexit) stops it, the reaper if the kernel dies. ipyparallel's own
        # exit handler would run first when its first controller starts after our stop was
        # registered, and stop it from under a background start still running: the controller
        # stayed behind (kernel shut down 1 s after %load_ext).
        shutdown_atexit=False,
    )


def _engine_env(preload: str | None, n: int, network: Any) -> dict[str, str]:
    """The environment new engines start with."""
    # torch only: importing it starts no threads and touches no device. TensorFlow starts its
    # runtime at import (and loads CUDA libraries before the GPU pinning); it is imported by
    # the warm-up call, after the engine registered.
    env = {"NBDIST_PRELOAD": preload if preload == "torch" else ""}
    if network is not None:
        env.update(network.engine_env())
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: OpenMP pools sized before the framework starts. Setting torch's
        # threads later is not enough; measured here, 2 workers' steps were ~6% slower.
        env["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // n))
    return env


def _start_failed(n: int, e: BaseException) -> ClusterError:
    """The start's error, with the advice that fits its cause."""
    cause = str(e)
    if cause.startswith("the ipyparallel controller"):
        advice = (
            "Check that ipyparallel is installed in this kernel's environment, then run "
            "%distrain start again."
        )
    elif "new engines registered within" in cause and n > 1:
        advice = (
            "A busy machine may not start them in time: run %distrain start again, or with "
            f"fewer workers (%distrain start -n {n // 2})."
        )
    else:
        advice = "Run %distrain start again."
    return ClusterError(f"could not start {n} local engines: {cause}. {advice}")


def _check_gpus(n: int) -> None:
    from IPython.core.error import UsageError

    gpus = visible_gpus()
    if gpus and n > len(gpus):
        raise UsageError(
            f"%%distrain: -n {n} asks for more workers than the {len(gpus)} visible GPUs "
            f"(one worker per GPU); use -n {len(gpus)}."
        )
