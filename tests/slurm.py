"""A real Slurm for the tests: Debian's ``slurm-wlm`` and ``munge``, on simulated hosts.

``SlurmCluster(["a", "b"])`` makes three hosts (network namespaces, see tests/hosts.py): ``login``
runs ``slurmctld`` (and the notebook's kernel, in the tests), ``nbh-a`` and ``nbh-b`` run one
``slurmd`` each, with their own hostname and address and 2 CPUs, in one partition ``main``. One
``munged`` serves them all (its socket is a file) with a key of the fixture's own. Everything
lives in one temporary folder: ``SLURM_CONF`` points at it, so no Slurm configuration of the
machine is read or written. The daemons are real; so are ``sbatch``, ``srun``, ``squeue`` and
``scancel``, which every command here and in nbdist runs.

Root only; ``SlurmCluster.skip_reason()`` says why not elsewhere. What was learnt setting it up
is in ``../shared/NOTES.md`` (``nsenter`` rather than ``ip netns exec`` for slurmd; linuxproc).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time

from tests.hosts import Hosts

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "sinfo", "scontrol")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def _which(tool: str) -> str | None:
    found = shutil.which(tool)
    if found:
        return found
    for folder in SBIN:
        if os.access(os.path.join(folder, tool), os.X_OK):
            return os.path.join(folder, tool)
    return None


class SlurmCluster:
    """A Slurm controller on host ``login`` and a ``slurmd`` on each of ``nodes``."""

    def __init__(self, nodes: list[str], *, cpus: int = 2, partition: str = "main") -> None:
        self.hosts = Hosts(["login", *nodes], sshd=False)
        self.login = self.hosts.names[0]
        self.nodes = self.hosts.names[1:]
        self.cpus = cpus
        self.partition = partition
        self.folder = self.hosts.folder / "slurm"
        self.conf = self.folder / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}

    @staticmethod
    def skip_reason() -> str | None:
        reason = Hosts.skip_reason()
        if reason and "sshd" not in reason:
            return reason
        if os.geteuid() != 0:
            return "a test Slurm needs root (network namespaces, slurmd)"
        for tool in (*DAEMONS, *CLIENTS, "nsenter"):
            if _which(tool) is None:
                return f"a test Slurm needs {tool} (apt-get install slurm-wlm munge)"
        return None

    # -- what the tests use ------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment every Slurm command needs: this cluster's configuration."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def address(self, host: str) -> str:
        return self.hosts.addresses[host]

    def run(
        self, argv: list[str], *, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess:
        """A Slurm command (``squeue``, ``scancel``, ...) on the login host."""
        return subprocess.run(
            [*self.hosts.exec_argv(self.login), *argv], env=self.env, capture_output=True,
            text=True, check=check, timeout=timeout,
        )  # fmt: skip

    def jobs(self) -> list[str]:
        """``squeue``'s lines for the jobs still known: id, state, reason, node list."""
        out = self.run(["squeue", "-h", "-o", "%i %T %r %N"])
        return [line for line in out.stdout.splitlines() if line.strip()]

    def wait_no_jobs(self, timeout: float = 20) -> list[str]:
        deadline = time.monotonic() + timeout
        while (jobs := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return jobs

    def kill_node(self, host: str) -> None:
        """The node dies: its ``slurmd`` and every process on it are killed with SIGKILL."""
        for pid in self.hosts.pids(host):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def revive(self, host: str) -> None:
        """A killed node back: its ``slurmd`` again, until Slurm shows it idle (a node that was
        down returns to service when its slurmd registers: ``ReturnToService=2``)."""
        self._start_slurmd(host)
        self.run(["scontrol", "update", f"nodename={host}", "state=resume"], check=False)
        self._wait(self._all_idle, f"{host} did not come back idle", "slurmctld.log", 60)

    # -- set-up ------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        with contextlib.ExitStack() as undo:  # whatever was started goes if a step fails
            undo.callback(self.close)
            self.hosts._make()
            self._start()
            undo.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        self.folder.mkdir(mode=0o700)
        (self.folder / "state").mkdir()
        for node in self.nodes:
            (self.folder / f"spool_{node}").mkdir()
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = self.folder / "munge.socket"
        self.daemons["munged"] = subprocess.Popen(
            [_which("munged"), "--foreground", "--force", f"--socket={self.socket}",
             f"--key-file={key}", f"--pid-file={self.folder / 'munged.pid'}",
             f"--log-file={self.folder / 'munged.log'}",
             f"--seed-file={self.folder / 'munged.seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._wait(lambda: self.socket.exists(), "munged made no socket", "munged.log")
        self.conf.write_text(self._config())
        log = self.folder / "slurmctld.log"
        self.daemons["slurmctld"] = self._daemon(
            self.login, [_which("slurmctld"), "-D", "-i", "-f", str(self.conf), "-L", str(log)]
        )
        for node in self.nodes:
            self._start_slurmd(node)
        self._wait(self._all_idle, "the nodes did not come up idle", "slurmctld.log", 60)

    def _start_slurmd(self, node: str) -> None:
        log = self.folder / f"slurmd_{node}.log"
        self.daemons[node] = self._daemon(
            node, [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf), "-L", str(log)]
        )

    def _daemon(self, host: str, argv: list[str]) -> subprocess.Popen:
        """``argv`` on ``host``: its network, and a hostname of its own (``unshare --uts``)."""
        command = f"hostname {host} && exec {' '.join(argv)}"
        return subprocess.Popen(
            [*self.hosts.enter_argv(host), "unshare", "--uts", "sh", "-c", command],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

    def _wait(self, ready, what: str, log: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}): {self.log(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:.0f} s: {self.log(log)}")
            time.sleep(0.3)

    def log(self, name: str) -> str:
        path = self.folder / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def _config(self) -> str:
        f = self.folder
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={self.address(n)} CPUs={self.cpus} State=UNKNOWN"
            for n in self.nodes
        )
        return (
            "ClusterName=nbdisttest\n"
            f"SlurmctldHost={self.login}({self.address(self.login)})\n"
            "AuthType=auth/munge\n"
            "CredType=cred/munge\n"
            f"AuthInfo=socket={self.socket}\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "SlurmctldPort=6817\nSlurmdPort=6818\n"
            f"StateSaveLocation={f / 'state'}\n"
            f"SlurmdSpoolDir={f}/spool_%n\n"
            f"SlurmctldPidFile={f / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={f}/slurmd_%n.pid\n"
            "ProctrackType=proctrack/linuxproc\n"
            "TaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/none\n"
            "JobCompType=jobcomp/none\n"
            "SelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_CPU\n"
            "MpiDefault=none\n"
            "ReturnToService=2\n"
            "SchedulerType=sched/backfill\n"
            # Finished jobs leave squeue at once; a killed job's processes get 2 s after SIGTERM.
            "MinJobAge=2\nKillWait=2\n"
            "SlurmdTimeout=10\nSlurmctldTimeout=10\n"
            "InactiveLimit=0\nWaitTime=0\n"
            f"{nodes}\n"
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        )

    def close(self) -> None:
        if "slurmctld" in self.daemons:
            self.run(["scancel", "--full", "-u", "root"], check=False, timeout=10)
        for _name, proc in reversed(list(self.daemons.items())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.hosts.close()
