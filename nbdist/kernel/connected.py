"""A connected cluster: an ipyparallel cluster started elsewhere (``ipcluster start`` with any
launcher, or a controller and engines started by hand) that ``%distrain connect`` attached to.

nbdist never starts, stops, kills or restarts its engines: they may run on other hosts, under a
launcher that owns them. An engine the controller stops hearing (it died, or its host is
unreachable) is left out, and the session goes on with those that answer; engines that register
later join at the next cell. When the workers need a restart only the user can give them, the
cluster is *stale*: every message says so, with the command to restart it in the words the
user connected with.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nbdist.engine import worker
from nbdist.errors import ClusterError
from nbdist.kernel.engines import (
    ENGINE_DIED,
    SETUP_TIMEOUT_S,
    EngineInfo,
    RankedEngines,
    settle_addresses,
)
from nbdist.kernel.runfiles import Reaper, kill_tree, run_dir, started
from nbdist.protocol import EngineReport

log = logging.getLogger(__name__)
# What ipyparallel's Cluster logs while it starts engines to heal a session ("Engine 1 not
# running": the dead engine it was told of): not for the notebook, where nbdist says what it did.
_launcher_log = logging.getLogger(f"{__name__}.launcher")
_launcher_log.propagate = False
_launcher_log.addHandler(logging.NullHandler())

LOOPBACK = "127.0.0.1"
RELAUNCH_TIMEOUT_S = 60.0  # for the engines a cluster's launcher starts to register


class ConnectedCluster(RankedEngines):
    """The engines of a cluster started elsewhere, by rank."""

    def __init__(self, *, notify: Callable[[str], None] = log.info) -> None:
        super().__init__(notify=notify)
        self.stale: str | None = None  # why the workers cannot run jobs any more
        self.preload: str | None = None  # unused: nbdist starts no engine here
        # How %distrain connect named the cluster (profile, cluster id, folder, file): the
        # messages say how to restart it in the same words.
        self.connected_with: dict[str, str | None] = {}
        # The engines nbdist had the cluster's launcher start to heal a session (an ipyparallel
        # Cluster of its own, and the engine set's id): nbdist stops them when it disconnects.
        self._relaunched: list[tuple[Any, str]] = []
        # The engines nbdist started for this cluster are its own to stop: a run record and its
        # reaper kill them when the kernel dies without stopping them (local launchers), and
        # an exit handler stops them when it exits; batch scripts go into a folder of nbdist's.
        self._reaper: Reaper | None = None
        self._scripts: Path | None = None
        self._exit_handler = False

    def connect(
        self,
        *,
        profile: str | None = None,
        cluster_id: str | None = None,
        profile_dir: str | None = None,
        url_file: str | None = None,
        timeout: float = 30.0,
        workers: int | None = None,
        before: Callable[[], None] = lambda: None,
    ) -> None:
        """Attach to the cluster; its engines become the workers once ``workers`` of them
        registered (else as many as its launcher started, when its cluster file says, else
        when no more come). ``before`` runs once the connection file is read and trusted
        (the notebook leaves its current workers there)."""
        from nbdist.kernel.connfile import open_client, wait_for_engines

        self.connected_with = {
            "profile": profile, "cluster_id": cluster_id, "profile_dir": profile_dir,
            "url_file": url_file,
        }  # fmt: skip
        client, where, launched = open_client(
            profile=profile, cluster_id=cluster_id, profile_dir=profile_dir, url_file=url_file,
            timeout=timeout, before=before,
        )  # fmt: skip
        self._client = client
        self.source = f"a connected ipyparallel cluster ({where})"
        try:
            wait_for_engines(
                client, n=workers or launched, timeout=timeout, where=where,
                restart=self.restart_text(), notify=self._notify,
            )  # fmt: skip
            self._learn_answering(timeout)
        except BaseException as e:  # an interrupt too: leave no half-connected state behind
            self._client = None
            self.engines = []
            client.close()
            if not isinstance(e, Exception) or isinstance(e, ClusterError):
                raise
            raise ClusterError(
                f"connected to {where}, but its engines did not answer within {timeout:.0f} s "
                f"({type(e).__name__}: {e}). Are they busy, or is nbdist missing from their "
                "Python environment (pip install nbdist there)?"
            ) from None

    def _learn_answering(self, timeout: float) -> None:
        """Rank the engines the controller lists, leaving out those that died as they were
        asked: the controller lists a stopped engine until its heartbeats are missed (a
        connect right after a disconnect that stopped engines nbdist had started met one)."""
        from ipyparallel.error import CompositeError

        try:
            self._learn_engines(timeout=timeout)
        except CompositeError as e:
            # (An engine the client learnt had died as it asked it has no engine_id here: None,
            # and the client's ids no longer list it.)
            died = {
                info.get("engine_id")
                for ename, _, _, info in e.elist
                if ename == ENGINE_DIED and isinstance(info, dict)
            }
            if not died or len(died) < len(e.elist):
                raise
            alive = sorted(set(self._client.ids) - died)
            if not alive:
                raise
            known = sorted(d for d in died if d is not None)
            which = (
                f"engine{'s' if len(known) > 1 else ''} {', '.join(map(str, known))}"
                if known
                else "an engine"  # (one the client saw die names no id)
            )
            self._notify(
                f"nbdist: {which} died as nbdist connected (the controller still listed it): "
                "left out"
            )
            self._learn_engines(alive, timeout=timeout)

    def stop(self, note: str | None = "the workers were stopped") -> None:
        """Disconnect: the engines keep running, except those nbdist started to heal a session
        (nobody else knows of them: ``ipcluster stop`` would leave them)."""
        client, self._client = self._client, None
        self._forget_engines(note)
        if client is not None:
            client.close()
        self.stale = None
        relaunched, self._relaunched = self._relaunched, []
        for cluster, engine_set in relaunched:
            # An engine that ran a collective may ignore the launcher's SIGTERM: the engine and
            # its nanny are killed first, then the launcher reaps them. (A batch or MPI
            # launcher starts no process here: its stop cancels its job, or signals mpiexec.)
            for pid in _pids(cluster.engines.get(engine_set)):
                kill_tree((pid, started(pid) or 0.0))
            try:
                cluster.stop_engines_sync(engine_set)
            except Exception:  # noqa: BLE001 - gone already
                log.debug("could not stop engine set %s", engine_set, exc_info=True)
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.stop()
        scripts, self._scripts = self._scripts, None
        if scripts is not None:
            shutil.rmtree(scripts, ignore_errors=True)

    def left_text(self) -> str:
        """What ``%distrain stop`` did, in words."""
        return (
            "nbdist: disconnected; the connected cluster's engines keep running, with what "
            "the cells left on them (this notebook no longer uses them)"
        )

    def restart_text(self) -> str:
        """What to type to restart the engines and connect again, in the words the user
        connected with (profile, profile folder or connection file)."""
        with_ = self.connected_with
        if with_.get("url_file"):
            return (
                "Restart the controller and engines that wrote "
                f"{with_['url_file']}, then %distrain connect --file {with_['url_file']}."
            )
        if with_.get("profile_dir"):
            flag = f"--profile-dir {with_['profile_dir']}"
        else:
            flag = f"--profile {with_.get('profile') or 'default'}"
        if with_.get("cluster_id"):
            flag += f" --cluster-id {with_['cluster_id']}"
        return (
            f"Restart them with ipcluster stop {flag}; ipcluster start {flag}, then "
            f"%distrain connect {flag}."
        )

    def not_ours(self, why: str | None = None) -> str:
        return (
            f"the workers need a restart{f' ({why})' if why else ''}, and nbdist does not "
            f"start or stop the engines of {self.source}. {self.restart_text()}"
        )

    def restart(self, n: int | None = None) -> None:
        raise ClusterError(self.not_ours())

    def ensure(self, n: int | None, *, note: str | None = None) -> None:
        """Check that the cluster can run a job on ``n`` engines: nbdist does not resize it."""
        if self.stale:
            raise ClusterError(self.stale)
        if n is not None and n > self.size:
            from IPython.core.error import UsageError

            raise UsageError(
                f"%%distrain: -n {n}, but the connected cluster has {self.size} engines. "
                f"Use -n {self.size} or fewer, or add engines with ipcluster engines."
            )

    def replace_engines(
        self,
        n: int | None = None,
        *,
        notice: str | None = None,
        why: str | None = None,
        note: str | None = None,
    ) -> None:
        """Not ours to restart: say so now, and refuse further runs until reconnected (the
        caller is reporting the failure that made the restart necessary)."""
        self.stale = self.not_ours(why)
        self._notify(f"nbdist: {self.stale}")

    def lose(self, ranks: Sequence[int], hosts: Sequence[str]) -> str:
        """The controller stopped hearing the engines of ``ranks`` during a job (they died, or
        ``hosts`` are unreachable): nothing is killed or restarted; the session goes on with
        the engines that answer ("shrunk"), or has none left ("stale")."""
        which = f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
        why = f"{which} stopped answering, on {', '.join(hosts)}"
        return "shrunk" if self._go_on_without(ranks, why, note=None) else "stale"

    def replace_dead(self, ranks: Sequence[int], gone: str) -> None:
        """Engines that died between cells: the others go on."""
        self._go_on_without(ranks, gone, note="the workers changed")

    def _go_on_without(self, ranks: Sequence[int], why: str, *, note: str | None) -> bool:
        """Go on with the engines that answer, ranked anew; whether any is left."""
        gone = {self.engines[r].engine_id for r in ranks}
        alive = sorted(set(self._client.ids) - gone)
        self._forget_engines(note)
        if not alive:
            self.stale = self.not_ours(why)
            self._notify(f"nbdist: {self.stale}")
            return False
        self._learn_engines(alive, timeout=SETUP_TIMEOUT_S)
        some = f"{len(alive)} engines that answer" if len(alive) > 1 else "1 engine that answers"
        self._notify(
            f"nbdist: going on with the {some} ({why}): ranks renumbered 0-{len(alive) - 1}"
        )
        return True

    def replace_ranks(self, ranks: Sequence[int]) -> bool:
        """Healing (``nbdist.kernel.healing``): new engines for the dead ``ranks`` where the
        cluster's own launcher can start them (True); else the engines that answer go on alone
        (False). Either way the engines are ranked anew without forgetting what the survivors
        hold; the caller gives every rank a survivor's variables."""
        gone = {self.engines[r].engine_id for r in ranks}
        alive = [e.engine_id for e in self.engines if e.engine_id not in gone]
        new = self._relaunch(len(gone))
        self._learn_engines(alive + (new or []), timeout=SETUP_TIMEOUT_S)
        return new is not None

    def _relaunch(self, n: int) -> list[int] | None:
        """Start ``n`` engines with the launcher ``ipcluster start`` used (its cluster file
        names it), and wait for them to register; None where that cannot be done: engines
        started by hand (no cluster file), or an SSH launcher (it starts its whole list of
        hosts at once, not ``n`` engines)."""
        from nbdist.kernel.connfile import launcher_config, profile_folder, read_cluster_file

        with_ = self.connected_with
        if with_.get("url_file"):
            return None
        kwargs = {"profile": with_.get("profile"), "profile_dir": with_.get("profile_dir")}
        data = read_cluster_file(cluster_id=with_.get("cluster_id"), **kwargs)
        launcher = str((data or {}).get("engines", {}).get("class", ""))
        if data is None or not launcher or "ssh" in launcher.lower():
            return None
        try:
            from ipyparallel import Cluster

            folder = profile_folder(**kwargs)
            config = launcher_config(folder)  # checked, read once: never loaded by its path
        except ClusterError as e:
            self._notify(f"nbdist: {e}")
            return None
        try:
            # A Cluster of nbdist's own, with the launcher (and the profile's configuration of
            # it) that ipcluster used, and no cluster file: ipcluster's stays as it wrote it.
            cluster = Cluster(
                profile_dir=str(folder), load_profile=False, config=config,
                cluster_id=with_.get("cluster_id") or "", engine_launcher_class=launcher,
                cluster_file="", log=_launcher_log,  # not its own log, which prints to stdout
            )  # fmt: skip
            launcher = cluster.engine_launcher_class.__name__
            self._private_job_script(cluster)
            old = set(self._client.ids)
            engine_set = cluster.start_engines_sync(n)
            self._relaunched.append((cluster, engine_set))
            self._watch_relaunched()
        except Exception as e:  # noqa: BLE001 - said, and the survivors go on
            self._notify(
                f"nbdist: the cluster's launcher ({launcher}) could not start engines: {e}"
            )
            return None
        try:
            new = self._registered(old, n, RELAUNCH_TIMEOUT_S)
        except ClusterError:
            self._notify(
                f"nbdist: the engines the cluster's launcher ({launcher}) started did not "
                f"register within {RELAUNCH_TIMEOUT_S:.0f} s"
            )
            return None
        self._notify(
            f"nbdist: the cluster's launcher ({launcher}) started {n} new "
            f"engine{'s' if n > 1 else ''} (nbdist stops {'them' if n > 1 else 'it'} when it "
            "disconnects)"
        )
        return new

    def _private_job_script(self, cluster: Any) -> None:
        """A batch launcher (Slurm, PBS, ...) writes its job script where it runs, the
        notebook's folder by default, following links, and has the scheduler read it by path:
        in a shared folder a planted link made a healing overwrite any file of the user's, and
        a rename before the scheduler read it ran another user's job. Its script goes into a
        folder of nbdist's own (0700, made afresh), under a name nobody else can take."""
        from ipyparallel.cluster.launcher import BatchSystemLauncher

        if not issubclass(cluster.engine_launcher_class, BatchSystemLauncher):
            return
        if self._scripts is None:
            self._scripts = Path(tempfile.mkdtemp(prefix="nbdist-jobs-", dir=run_dir()))
        name = f"{cluster.engine_launcher_class.__name__}-{uuid.uuid4().hex[:8]}.sh"
        # ipyparallel joins its work folder and this name: an absolute name is the path.
        cluster.config[cluster.engine_launcher_class.__name__].batch_file_name = str(
            self._scripts / name
        )

    def _watch_relaunched(self) -> None:
        """The engines nbdist started are stopped with it: at the kernel's exit (an exit
        handler), and when the kernel is killed (the reaper, which kills the processes of a
        run record; a local launcher's engines have processes here to record)."""
        if not self._exit_handler:
            atexit.register(self.stop)
            self._exit_handler = True
        pids = [p for cluster, s in self._relaunched for p in _pids(cluster.engines.get(s))]
        if not pids:
            return
        if self._reaper is None:
            self._reaper = Reaper(run_dir())
        self._reaper.record.write(pids)

    def newcomers(self) -> list[int]:
        """Engines that registered after nbdist ranked the others (a launcher still starting
        them, a host that came back)."""
        if self._client is None:
            return []
        known = {e.engine_id for e in self.engines}
        return sorted(set(self._client.ids) - known)

    def take_newcomers(self) -> None:
        """Rank every engine the controller has now, newcomers included, with a notice."""
        new = self.newcomers()
        if not new:
            return
        before = self.size
        self._forget_engines("the workers were ranked anew")
        self._learn_engines(timeout=SETUP_TIMEOUT_S)
        self._notify(
            f"nbdist: {len(new)} engine{'s' if len(new) > 1 else ''} registered since "
            f"({before} before, {self.size} now): the workers are ranked anew and their "
            "process group rebuilt"
        )

    # -- the engines, as far as the controller tells ---------------------------------------------
    def kill(self, ranks: Sequence[int]) -> bool:
        return False  # engines started elsewhere are not nbdist's to kill

    def dead(self, ranks: Sequence[int]) -> list[int]:
        """No process to look at: an engine is dead when the hub says so."""
        alive = set(self._client.ids)
        return [r for r in ranks if self.engines[r].engine_id not in alive]

    def tf_exposure(self) -> str | None:
        hosts = sorted({e.address for e in self.engines})
        return f"anyone who can reach the engines' hosts ({', '.join(hosts)}) on {self.source}"

    def describe_lost(self, where: str, count: int, hosts: Sequence[str]) -> str | None:
        """What engines the controller stopped hearing mid-job are: not a known death."""
        return (
            f"{where} stopped answering during the job: the controller lost "
            f"{'its' if count == 1 else 'their'} heartbeat (died, or {', '.join(hosts)} "
            "unreachable)"
        )

    def status_notes(self) -> list[str]:
        """The Slurm jobs the engines run in (ipcluster's Slurm launcher), as squeue sees them."""
        from nbdist.kernel.slurm import job_notes

        return job_notes(self.engines)

    def _peer(self) -> str:
        """The controller's address as the client reached it: engines find the interface they
        use towards it (see ``hardware.reachable_address``)."""
        from urllib.parse import urlparse

        # ipyparallel keeps the connection file's content, the interface made concrete, here.
        return urlparse(self._client._config["interface"]).hostname or LOOPBACK

    def _settle(self, infos: list[EngineReport]) -> list[EngineReport]:
        return settle_addresses(infos, local=None)

    def _learned(self, engines: list[EngineInfo]) -> None:
        ids = [e.engine_id for e in engines]
        self._client[ids].map_sync(worker.set_address, [e.address for e in engines])


def _pids(engine_set: Any) -> list[int]:
    """The processes a launcher started here for an engine set: a local launcher's, one per
    engine; an MPI launcher's mpiexec; none for a batch job (its scheduler's)."""
    launchers = getattr(engine_set, "launchers", None)
    if launchers is not None:
        return [launcher.pid for launcher in list(launchers.values()) if launcher.pid > 0]
    pid = getattr(engine_set, "pid", None)
    return [pid] if isinstance(pid, int) and pid > 0 else []
