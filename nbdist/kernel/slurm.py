"""Engines from Slurm: ``%distrain start --slurm`` asks Slurm for nodes from the notebook.

nbdist writes the engines' batch script itself (every ``#SBATCH`` line it asks for is in the
script, the user's ``--sbatch`` options too), has ``sbatch --test-only`` judge it first (a
refusal is quoted in sbatch's own words, and no job is queued), then starts an ipyparallel
controller here, listening on the address the nodes reach this host at, and has ipyparallel's
Slurm launcher submit the job. While the job is pending its state is shown as ``squeue`` gives
it; once its engines have registered they become the workers, ranked as Slurm numbers its tasks.

The job is nbdist's to end: ``%distrain stop``, the kernel's exit (an exit handler) and a
kernel killed outright (the reaper, from the run record) all cancel it. The job's script, its
output (what the engines print before they register, srun's errors: quoted when the job ends
before its engines come) and the engines' profile folder go into a private folder in the home
folder (``~/.nbdist/slurm``), which the nodes see too, removed at the stop.

Plain functions (the script, the parsing of Slurm's answers) are kept apart from
:class:`SlurmJobCluster`, which runs them.
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbdist.engine.stopping import STOP_SIGNAL
from nbdist.errors import ClusterError
from nbdist.kernel.connected import ConnectedCluster, _launcher_log
from nbdist.kernel.engines import SETUP_TIMEOUT_S, EngineInfo
from nbdist.kernel.runfiles import Reaper, run_dir

log = logging.getLogger(__name__)

SQUEUE_TIMEOUT_S = 10.0  # for one squeue, sbatch --test-only or scancel
POLL_S = 1.0  # how often a pending job's state is read
DEFAULT_WARN_S = 300  # the time-limit warning comes this long before the end
DEFAULT_TIMEOUT_S = 600.0  # how long a job may stay pending before it is cancelled
HEARTBEAT_MS = 1000  # a node lost is noticed after MISSES heartbeats
MISSES = 6


@dataclass(frozen=True)
class SlurmRequest:
    """What ``%distrain start --slurm`` asks Slurm for."""

    nodes: int
    per_node: int
    gpus_per_node: int | None = None
    time: str | None = None  # sbatch --time, as Slurm takes it ("30", "1:00:00", "1-0")
    partition: str | None = None
    account: str | None = None
    warn: int = DEFAULT_WARN_S
    sbatch: tuple[str, ...] = ()  # more sbatch options, one word each
    controller_ip: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S

    @property
    def tasks(self) -> int:
        return self.nodes * self.per_node

    def words(self) -> str:
        """The request as it is typed after ``%distrain start --slurm``."""
        out = [f"--nodes {self.nodes}", f"--per-node {self.per_node}"]
        for flag, value in (
            ("--gpus-per-node", self.gpus_per_node), ("--time", self.time),
            ("--partition", self.partition), ("--account", self.account),
        ):  # fmt: skip
            if value is not None:
                out.append(f"{flag} {value}")
        if self.warn != DEFAULT_WARN_S:
            out.append(f"--warn {self.warn}")
        if self.sbatch:
            out.append(f'--sbatch "{shlex.join(self.sbatch)}"')
        return " ".join(out)


def sbatch_lines(request: SlurmRequest, *, name: str, output: Path) -> list[str]:
    """The ``#SBATCH`` lines of the engines' job, in the order sbatch reads them: the user's
    own options last, so that they win where they repeat one of ours."""
    lines = [
        f"--job-name={name}",
        "--export=ALL",
        f"--nodes={request.nodes}",
        f"--ntasks-per-node={request.per_node}",
        f"--ntasks={request.tasks}",
        f"--output={output}",
    ]
    # The time-limit warning: nbdist's graceful-stop signal to the engines (every step's tasks,
    # not the batch shell): a running cell stops at a step boundary.
    lines.append(f"--signal={STOP_SIGNAL.name.removeprefix('SIG')}@{request.warn}")
    # A node lost does not end the job: the engines on the others go on, and the session heals.
    lines.append("--no-kill")
    if request.gpus_per_node:
        lines.append(f"--gpus-per-node={request.gpus_per_node}")
    if request.time:
        lines.append(f"--time={request.time}")
    if request.partition:
        lines.append(f"--partition={request.partition}")
    if request.account:
        lines.append(f"--account={request.account}")
    lines += request.sbatch
    return [f"#SBATCH {line}" for line in lines]


def job_script(request: SlurmRequest, *, name: str, output: Path, program: str) -> str:
    """The engines' batch script: one engine per task, ``srun`` starting them on every node
    (``program``: the engine's command line, as the shell reads it). Each engine's OpenMP pool
    gets its share of its node's CPUs, as torchrun gives it."""
    return "\n".join(
        [
            "#!/bin/sh",
            *sbatch_lines(request, name=name, output=output),
            "# written by nbdist (%distrain start --slurm)",
            f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( (SLURM_CPUS_ON_NODE + '
            f'{request.per_node - 1}) / {request.per_node} ))}}"',
            f"srun --kill-on-bad-exit=0 --no-kill {program}",
            "",
        ]
    )


PROGRAM = "{program_and_args}"  # where ipyparallel's launcher puts the engine's command line


def template(script: str) -> str:
    """``script`` as an ipyparallel batch template: its formatter fills :data:`PROGRAM` (the
    engine's command with the profile and cluster it joins) and would read any other brace."""
    return script.replace("{", "{{").replace("}", "}}").replace("{" + PROGRAM + "}", PROGRAM)


def refusal(stderr: str) -> str:
    """sbatch's reason for refusing a job, in its own words (its ``error:`` and, from
    ``--test-only``, ``allocation failure:`` lines), each said once."""
    errors: list[str] = []
    for line in stderr.splitlines():
        for mark in ("error:", "allocation failure:"):
            if mark in line:
                words = line.split(mark, 1)[1].strip()
                if words and words.lower() not in (e.lower() for e in errors):
                    errors.append(words)
    return "; ".join(errors) or stderr.strip() or "no reason given"


@dataclass(frozen=True)
class JobState:
    """One job as ``squeue`` shows it."""

    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str  # why it is pending ("Resources", "Priority"); "None" when running
    nodes: str  # its node list ("" while pending)
    left: str  # its time left ("UNLIMITED", "59:48", "1-00:00:00")
    limit: str  # its time limit

    def words(self) -> str:
        if self.state == "PENDING" and self.reason not in ("", "None"):
            return f"PENDING ({self.reason})"
        return self.state


SQUEUE_FORMAT = "%T|%r|%N|%L|%l"


def parse_squeue(text: str) -> JobState | None:
    """The first line of ``squeue -h -o SQUEUE_FORMAT``; None when there is none."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 5:
            return JobState(*parts)
    return None


def seconds(slurm_time: str) -> int | None:
    """Slurm's ``[days-]hours:minutes:seconds`` (or ``minutes:seconds``) in seconds; None for
    ``UNLIMITED``, ``NOT_SET`` and the like."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", slurm_time.strip())
    if m is None:
        return None
    days, hours, minutes, secs = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def _run(argv: list[str], timeout: float = SQUEUE_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def job_state(job: str) -> JobState | None:
    """``squeue``'s view of ``job``; None once it has left the queue (or squeue failed)."""
    try:
        out = _run(["squeue", "-h", "-j", job, "-o", SQUEUE_FORMAT])
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_squeue(out.stdout) if out.returncode == 0 else None


def cancel(job: str) -> str | None:
    """``scancel`` the job; what went wrong, or None."""
    try:
        out = _run(["scancel", job])
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return refusal(out.stderr) if out.returncode != 0 else None


def first_node_address(partition: str | None) -> str | None:
    """The address of the first node of ``partition`` (the default one), as Slurm knows it."""
    argv = ["sinfo", "-h", "-N", "-o", "%N"] + (["-p", partition] if partition else [])
    try:
        out = _run(argv)
        node = out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else None
        if node is None:
            return None
        shown = _run(["scontrol", "show", "node", "-o", node]).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", shown)
    return m.group(1) if m else node


def controller_ip(request: SlurmRequest) -> str:
    """Where the controller listens: ``--controller-ip``, else this host's address on the route
    to the partition's first node (what the nodes reach it at)."""
    if request.controller_ip:
        return request.controller_ip
    import socket

    from nbdist.engine.hardware import reachable_address

    node = first_node_address(request.partition)
    if node is None:
        raise ClusterError(
            "nbdist could not find a node of the partition to route to (sinfo showed none). "
            "Give the address the nodes reach this host at: %distrain start --slurm ... "
            "--controller-ip ADDRESS"
        )
    try:
        address = socket.gethostbyname(node)
    except OSError:
        raise ClusterError(
            f"nbdist cannot resolve the node {node} to route to it. Give the address the "
            "nodes reach this host at: --controller-ip ADDRESS"
        ) from None
    return reachable_address(address)


def job_folder() -> Path:
    """Where a job's script, profile and output go: a private folder in the home folder, which
    the nodes share with the login node as a rule. Not nbdist's run folder: ``XDG_RUNTIME_DIR``
    exists on the login node only, and the job's output file and the engines' profile folder
    must open on the nodes."""
    from nbdist.kernel.runfiles import private_dir

    return private_dir(Path.home() / ".nbdist" / "slurm")


def job_notes(engines: Sequence[EngineInfo]) -> list[str]:
    """``%distrain status`` lines on the Slurm jobs the engines run in: state, nodes, time
    left (as ``squeue`` gives them now)."""
    jobs: dict[str, list[str]] = {}
    for e in engines:
        if e.slurm is not None:
            nodes = jobs.setdefault(e.slurm.job, [])
            if e.slurm.nodename and e.slurm.nodename not in nodes:
                nodes.append(e.slurm.nodename)
    lines = []
    for job, nodes in jobs.items():
        state = job_state(job)  # None where there is no squeue
        line = f"Slurm job {job}: nodes {', '.join(nodes) or '?'}"
        if state is not None:
            line += f", {state.words()}, time left {state.left}"
            if state.limit not in ("", state.left):
                line += f" of {state.limit}"
        lines.append(line)
    return lines


@dataclass
class _Job:
    """One Slurm job of engines nbdist submitted: the ipyparallel Cluster whose launcher
    submitted it, its engine set, and where its output goes."""

    cluster: Any
    engine_set: str
    job: str
    output: Path
    tasks: int
    seen: list[str] = field(default_factory=list)  # the states shown while it waited


class SlurmJobCluster(ConnectedCluster):
    """Engines in a Slurm job nbdist submitted, and the controller it started here for them."""

    def __init__(self, request: SlurmRequest, *, notify: Callable[[str], None] = log.info) -> None:
        super().__init__(notify=notify)
        self.request = request
        self.jobs: list[_Job] = []
        self.cancelled: list[str] = []  # the jobs the last stop cancelled
        self._lost_nodes: list[str] = []  # where the ranks a healing replaces ran
        self._ends: float | None = None  # when the job's time limit ends it (monotonic clock)
        self._controller: Any = None  # the ipyparallel Cluster that runs the controller

    # -- start -----------------------------------------------------------------------------
    def start_job(self, *, before: Callable[[], None] = lambda: None) -> None:
        """Judge the request, start the controller, submit the job, show its state while it
        is pending, and rank its engines once all have registered. ``before`` runs once Slurm
        accepted the request (the notebook leaves its current workers there)."""
        from nbdist.kernel.local import engine_command

        request = self.request
        missing = [t for t in ("sbatch", "squeue", "scancel", "srun") if not shutil.which(t)]
        if missing:
            raise ClusterError(
                f"%distrain start --slurm: no {missing[0]} on PATH here. Run the notebook where "
                "Slurm's commands are (a login node of the cluster), or put their folder on "
                "PATH (os.environ['PATH'])."
            )
        self._scripts = Path(tempfile.mkdtemp(prefix="job-", dir=job_folder()))
        try:
            self._judge(engine_command())
            ip = controller_ip(request)
            before()
            self._start_controller(ip)
            job = self._submit(request.tasks, request, engine_command())
            running = self._wait_running(job, request.timeout)
            left = seconds(running.left)
            self._ends = None if left is None else time.monotonic() + left
            new = self._wait_engines(job, set(), SETUP_TIMEOUT_S)
            self._learn_engines(new, timeout=SETUP_TIMEOUT_S)
        except KeyboardInterrupt:
            jobs = [j.job for j in self.jobs]
            self.stop(note=None)
            raise ClusterError(
                "%distrain start --slurm was interrupted"
                + (f": Slurm job {', '.join(jobs)} cancelled" if jobs else "")
                + ", nothing is left queued or running."
            ) from None
        except BaseException:
            self.stop(note=None)
            raise
        self.source = f"Slurm job {job.job} ({request.words()}), controller on {ip}"

    @property
    def _folder(self) -> Path:
        """The job's folder of scripts and output (made as the job starts)."""
        assert self._scripts is not None
        return self._scripts

    def _judge(self, program: Sequence[str]) -> None:
        """``sbatch --test-only`` on the very script: Slurm's refusal, in its words, before any
        job is queued (a partition or account it does not know, more than the cluster has)."""
        path = self._folder / "test-only.sh"
        output = self._folder / "test-only.out"
        path.write_text(
            job_script(self.request, name="nbdist-test", output=output, program=shlex.join(program))
        )
        try:
            out = _run(["sbatch", "--test-only", str(path)], timeout=30)
        except subprocess.TimeoutExpired:
            raise ClusterError(
                "%distrain start --slurm: sbatch --test-only did not answer within 30 s: is "
                "slurmctld reachable from here (scontrol ping)?"
            ) from None
        if out.returncode != 0:
            raise ClusterError(
                f"%distrain start --slurm {self.request.words()}: Slurm refused the job: "
                f"{refusal(out.stderr)}. Nothing was queued. (sinfo shows the partitions and "
                "nodes; sacctmgr show assoc user=$USER the accounts.)"
            )

    def _start_controller(self, ip: str) -> None:
        import ipyparallel as ipp

        folder = self._folder / "profile"
        folder.mkdir(mode=0o700)
        self._reaper = Reaper(run_dir())
        cluster = ipp.Cluster(
            profile_dir=str(folder), load_profile=False, cluster_id=uuid.uuid4().hex[:8],
            controller_ip=ip, cluster_file="", log=_launcher_log, log_level=logging.ERROR,
            controller_args=[
                f"--HeartMonitor.period={HEARTBEAT_MS}",
                f"--HeartMonitor.max_heartmonitor_misses={MISSES}",
                # Every message between the notebook, the controller and the nodes encrypted.
                "--IPController.enable_curve=True",
            ],
            shutdown_atexit=False,
        )  # fmt: skip
        self._controller = cluster
        self._watch_jobs()
        cluster.start_controller_sync()
        self._watch_jobs()
        from nbdist.kernel.connfile import quiet_late_replies

        self._client = quiet_late_replies(cluster.connect_client_sync())

    def _submit(self, n: int, request: SlurmRequest, program: Sequence[str]) -> _Job:
        """A job of ``n`` engines, submitted by ipyparallel's Slurm launcher with nbdist's
        script; its id is said at once."""
        from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

        cluster = self._controller
        name = f"nbdist-{cluster.cluster_id}"
        output = self._folder / f"job-{len(self.jobs)}-%j.out"
        launcher = cluster.config.SlurmEngineSetLauncher
        launcher.batch_template = template(
            job_script(request, name=name, output=output, program=PROGRAM)
        )
        launcher.batch_file_name = str(self._folder / f"job-{len(self.jobs)}.sh")
        # The launcher appends its own arguments to engine_cmd: the profile and the cluster id.
        launcher.engine_cmd = list(program)
        cluster.engine_launcher_class = SlurmEngineSetLauncher
        try:
            engine_set = cluster.start_engines_sync(n)
        except subprocess.CalledProcessError as e:  # judged fine, refused at submission
            raise ClusterError(
                f"sbatch refused the job at submission (exit {e.returncode}), though "
                "sbatch --test-only accepted it (a limit of your account or QOS?): its words "
                "went to the kernel's log (the Jupyter server's terminal). sacctmgr show assoc "
                "user=$USER shows your limits."
            ) from None
        job_id = str(cluster.engines[engine_set].job_id)
        job = _Job(cluster, engine_set, job_id, Path(str(output).replace("%j", job_id)), n)
        self.jobs.append(job)
        self._watch_jobs()
        self._notify(
            f"nbdist: Slurm job {job_id} submitted: {request.nodes} node"
            f"{'s' if request.nodes > 1 else ''} × {request.per_node} engine"
            f"{'s' if request.per_node > 1 else ''}"
            + (f", partition {request.partition}" if request.partition else "")
            + (f", time {request.time}" if request.time else "")
        )
        return job

    def _wait_running(self, job: _Job, timeout: float) -> JobState:
        """Show the job's state while it waits; its state once it runs. A job still pending after
        ``timeout`` seconds is cancelled; one that ended is an error with its output."""
        deadline = time.monotonic() + timeout
        while True:
            state = job_state(job.job)
            if state is None or state.state not in ("PENDING", "CONFIGURING"):
                if state is None or state.state not in ("RUNNING", "COMPLETING"):
                    raise ClusterError(self._ended(job, state))
                engines = f"{job.tasks} engines" if job.tasks > 1 else "engine"
                self._notify(f"nbdist: Slurm job {job.job} RUNNING on {state.nodes}; "
                             f"waiting for its {engines}")  # fmt: skip
                return state
            words = state.words()
            if words not in job.seen:
                job.seen.append(words)
                self._notify(f"nbdist: Slurm job {job.job} {words}")
            if time.monotonic() > deadline:
                cancel(job.job)
                raise ClusterError(
                    f"Slurm job {job.job} was still {words} after {timeout:g} s: nbdist "
                    "cancelled it. Ask for less (--nodes, --time), another --partition, or wait "
                    "longer: %distrain start --slurm ... --timeout SECONDS"
                )
            time.sleep(POLL_S)

    def _wait_engines(self, job: _Job, old: set[int], timeout: float) -> list[int]:
        """The ids of the job's engines, once all have registered."""

        def ended() -> str | None:
            state = job_state(job.job)
            if state is None or state.state not in ("RUNNING", "COMPLETING", "CONFIGURING"):
                return self._ended(job, state)
            return None

        return self._registered(old, job.tasks, timeout, exited=_every(2.0, ended))

    def _ended(self, job: _Job, state: Any) -> str:
        how = state.words() if state is not None else "ended"
        text = ""
        try:
            text = job.output.read_text(errors="replace").strip()[-1500:]
        except OSError:
            pass
        return (
            f"Slurm job {job.job} {how.lower() if state is None else how} before its engines "
            f"registered. Its output ({job.output}):\n{text or '(empty)'}"
        )

    def _watch_jobs(self) -> None:
        """What the reaper must end if the kernel dies: the controller's processes here, and
        the Slurm jobs (cancelled with scancel)."""
        import atexit

        if not self._exit_handler:
            atexit.register(self.stop)
            self._exit_handler = True
        if self._reaper is None:
            return
        pids = []
        controller = getattr(self._controller, "controller", None)
        if controller is not None and getattr(controller, "pid", None):
            pids.append(controller.pid)
        self._reaper.record.write(pids, jobs=[j.job for j in self.jobs], folder=str(self._scripts))

    # -- healing: a new job for the ranks that were lost -----------------------------------
    def replace_ranks(self, ranks: Sequence[int]) -> bool:
        """As a connected cluster's, the new engines from a new job that keeps off the nodes
        the lost ranks ran on (Slurm may not know yet that they are gone)."""
        self._lost_nodes = sorted(
            {e.slurm.nodename for r in ranks if (e := self.engines[r]).slurm and e.slurm.nodename}
        )
        return super().replace_ranks(ranks)

    def _relaunch(self, n: int) -> list[int] | None:
        from nbdist.kernel.local import engine_command

        request = self.request
        nodes = max(1, math.ceil(n / request.per_node))
        avoid = self._lost_nodes
        extra = (*request.sbatch, f"--exclude={','.join(avoid)}") if avoid else request.sbatch
        smaller = SlurmRequest(**{**request.__dict__, "nodes": nodes, "sbatch": extra})
        old = set(self._client.ids)
        try:
            job = self._submit(n, smaller, engine_command())
            self._wait_running(job, min(request.timeout, 120.0))
            new = self._wait_engines(job, old, SETUP_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - said; the survivors go on
            self._notify(f"nbdist: Slurm could not give new engines: {e}")
            return None
        return new

    # -- what the user reads and types -----------------------------------------------------
    def restart(self, n: int | None = None) -> None:
        """``%distrain restart``: the job cancelled, and the same request submitted again."""
        if n is not None and n != self.request.tasks:
            from IPython.core.error import UsageError

            raise UsageError(
                f"%distrain restart -n {n}: the Slurm job's workers are --nodes × --per-node "
                f"({self.request.tasks}); %distrain start --slurm --nodes N --per-node K asks "
                "for another shape"
            )
        self.stop(note="the Slurm job was cancelled for a new one")
        self.start_job()

    def ensure(self, n: int | None, *, note: str | None = None) -> None:
        if n is not None and n > self.size and not self.stale:
            from IPython.core.error import UsageError

            raise UsageError(
                f"%%distrain: -n {n}, but the Slurm job has {self.size} engines. Use -n "
                f"{self.size} or fewer, or ask Slurm for more: %distrain start --slurm --nodes N "
                "--per-node K"
            )
        super().ensure(n, note=note)

    def restart_text(self) -> str:
        return (
            "%distrain restart submits the same job again (or %distrain start --slurm "
            f"{self.request.words()})."
        )

    def not_ours(self, why: str | None = None) -> str:
        return f"the workers need a restart{f' ({why})' if why else ''}. {self.restart_text()}"

    def status_notes(self) -> list[str]:
        return job_notes(self.engines)

    def outside_stop(self) -> str:
        """A graceful stop the notebook did not ask for: Slurm's time-limit warning (the job
        script asks for it: ``--signal=USR1@WARN``)."""
        job = self.jobs[0].job if self.jobs else "?"
        state = job_state(job) if self.jobs else None
        left = f": {state.left} left of its {state.limit}" if state is not None else ""
        return f"the time-limit warning of Slurm job {job}{left}"

    def near_end(self) -> str | None:
        """Within ``--warn`` seconds of the job's time limit (read once, at its start: no
        squeue per cell), the job and what is left in words; else None."""
        if self._ends is None or not self.jobs:
            return None
        left = self._ends - time.monotonic()
        if left > self.request.warn:
            return None
        left = max(0, int(left))
        return f"Slurm job {self.jobs[0].job} ends in {left // 60}:{left % 60:02d}"

    # -- stop ------------------------------------------------------------------------------
    def left_text(self) -> str:
        jobs = ", ".join(self.cancelled) or "?"
        return (
            f"nbdist: Slurm job{'s' if len(self.cancelled) > 1 else ''} {jobs} cancelled, and "
            "the controller stopped: the workers and their variables are gone"
        )

    def stop(self, note: str | None = "the workers were stopped") -> None:
        """Cancel every job, stop the controller, remove the scripts: no allocation is left."""
        jobs, self.jobs = self.jobs, []
        self.cancelled = [j.job for j in jobs] or self.cancelled
        client, self._client = self._client, None
        self._forget_engines(note)
        if client is not None:
            client.close()
        self.stale = None
        for job in jobs:
            problem = cancel(job.job)
            if problem and job_state(job.job) is not None:
                self._notify(f"nbdist: could not cancel Slurm job {job.job}: {problem}; "
                             f"scancel {job.job} does it")  # fmt: skip
        controller, self._controller = self._controller, None
        if controller is not None:
            try:
                controller.stop_controller_sync()
            except Exception:  # noqa: BLE001 - the reaper's stop kills what is left of it
                log.debug("could not stop the controller", exc_info=True)
        super().stop(note=None)  # the reaper's stop: what the record lists is gone after it


def _every(interval: float, check: Callable[[], str | None]) -> Callable[[], str | None]:
    """``check``, run at most once per ``interval`` seconds (None in between)."""
    last = [0.0]

    def maybe() -> str | None:
        now = time.monotonic()
        if now - last[0] < interval:
            return None
        last[0] = now
        return check()

    return maybe
