"""Simulated hosts for the two-host tests: Linux network namespaces that behave like machines.

Each host is a network namespace with an ``eth0`` (its own address on a private /24) and an
``sshd`` listening on that address, in a UTS namespace of its own so that ``hostname`` names it
(``nbh-a``, ``nbh-b``): names that resolve nowhere, like compute nodes without DNS. The hosts'
``eth0`` are joined by a bridge that lives in a namespace of its own, so the root namespace has
no address or route to them: no route out, no NAT. A host's link can be cut and restored
(``cut``/``restore``). The file system is shared, as on a cluster with a shared home: the same
Python and venv run everywhere.

Root only (namespaces, sshd); ``Hosts.skip_reason()`` says why not elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

SUBNET = "10.77.{}"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Hosts:
    """``Hosts(["a", "b"])``: hosts ``nbh-a``, ``nbh-b`` at 10.77.N.1, .2 (N random per run)."""

    def __init__(self, names: list[str], *, sshd: bool = True) -> None:
        self.with_sshd = sshd
        self.tag = uuid.uuid4().hex[:6]
        self.net = SUBNET.format(int(self.tag[:2], 16) % 200 + 20)
        self.names = [f"nbh-{n}" for n in names]
        self.addresses = {h: f"{self.net}.{i + 1}" for i, h in enumerate(self.names)}
        self.bridge_ns = f"nbd-br-{self.tag}"
        self.folder = Path(tempfile.mkdtemp(prefix="nbdist-hosts-"))
        self.sshd: dict[str, subprocess.Popen] = {}
        self.ssh_config = self.folder / "ssh_config"

    @staticmethod
    def skip_reason() -> str | None:
        if os.geteuid() != 0:
            return "simulated hosts need root (network namespaces, sshd)"
        for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
            if shutil.which(tool) is None:
                return f"simulated hosts need {tool}"
        if not os.path.exists("/usr/sbin/sshd"):
            return "simulated hosts need sshd (apt-get install openssh-server)"
        return None

    def ns(self, host: str) -> str:
        return f"nbd-{host}-{self.tag}"

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _ip("link", "set", "br0", "up", ns=self.bridge_ns)
        for i, host in enumerate(self.names):
            ns, peer = self.ns(host), f"v{i}{self.tag}"
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", peer,
                "netns", self.bridge_ns)  # fmt: skip
            _ip("link", "set", peer, "master", "br0", ns=self.bridge_ns)
            _ip("link", "set", peer, "up", ns=self.bridge_ns)
            _ip("addr", "add", f"{self.addresses[host]}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        if not self.with_sshd:
            return
        self._ssh_keys()
        os.makedirs("/run/sshd", exist_ok=True)
        for host in self.names:
            self._start_sshd(host)
        for host in self.names:
            self._wait_ssh(host)

    def _ssh_keys(self) -> None:
        key = self.folder / "id_ed25519"
        hostkey = self.folder / "host_ed25519"
        for path in (key, hostkey):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                           check=True)  # fmt: skip
        (self.folder / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
        (self.folder / "authorized_keys").chmod(0o600)
        lines = []
        for host, address in self.addresses.items():
            lines += [
                f"Host {host}",
                f"  HostName {address}",
                "  User root",
                f"  IdentityFile {key}",
                "  StrictHostKeyChecking no",
                "  UserKnownHostsFile /dev/null",
                "  LogLevel ERROR",
                "  BatchMode yes",
                "  ConnectTimeout 5",
            ]
        self.ssh_config.write_text("\n".join(lines) + "\n")

    def _start_sshd(self, host: str) -> None:
        config = self.folder / f"sshd_{host}"
        config.write_text(
            f"ListenAddress {self.addresses[host]}\n"
            f"HostKey {self.folder / 'host_ed25519'}\n"
            f"AuthorizedKeysFile {self.folder / 'authorized_keys'}\n"
            f"PidFile {self.folder / f'sshd_{host}.pid'}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "AcceptEnv *\n"
            "PermitUserEnvironment no\n"
            "Subsystem sftp internal-sftp\n"
        )
        self.sshd[host] = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "sh", "-c",
             f"hostname {host} && exec /usr/sbin/sshd -D -e -f {config}"],
            stdout=subprocess.DEVNULL,
            stderr=open(self.folder / f"sshd_{host}.log", "wb"),  # noqa: SIM115
        )  # fmt: skip

    def _wait_ssh(self, host: str) -> None:
        deadline = time.monotonic() + 20
        while True:
            out = self.run(host, ["hostname"], check=False, timeout=10, via=self.names[0])
            if out.returncode == 0 and out.stdout.strip() == host:
                return
            if time.monotonic() > deadline:
                log = (self.folder / f"sshd_{host}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd on {host} did not answer: {out.stderr} {log}")
            time.sleep(0.3)

    def exec_argv(self, host: str) -> list[str]:
        """The prefix that runs a command on ``host`` locally (in its namespace)."""
        return ["ip", "netns", "exec", self.ns(host)]

    def enter_argv(self, host: str) -> list[str]:
        """Like :meth:`exec_argv`, but keeping the machine's ``/sys`` (and its cgroup tree), which
        ``ip netns exec`` replaces: a daemon that reads cgroups (``slurmd``) needs it."""
        return ["nsenter", f"--net=/run/netns/{self.ns(host)}"]

    def ssh_argv(self, host: str) -> list[str]:
        return ["ssh", "-F", str(self.ssh_config), host]

    def run(
        self, host: str, argv: list[str], *, via: str | None = None, check: bool = True,
        timeout: float = 120, env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:  # fmt: skip
        """``argv`` on ``host`` over ssh, from host ``via`` (by default the first one)."""
        via = via or self.names[0]
        remote = " ".join(_quote(a) for a in argv)
        if env:
            remote = " ".join(f"{k}={_quote(v)}" for k, v in env.items()) + " " + remote
        return subprocess.run(
            [*self.exec_argv(via), *self.ssh_argv(host), remote],
            capture_output=True, text=True, timeout=timeout, check=check,
        )  # fmt: skip

    def cut(self, host: str) -> None:
        """Take ``host``'s link down (its cable pulled): its processes go on, unreachable."""
        peer = f"v{self.names.index(host)}{self.tag}"
        _ip("link", "set", peer, "down", ns=self.bridge_ns)

    def restore(self, host: str) -> None:
        peer = f"v{self.names.index(host)}{self.tag}"
        _ip("link", "set", peer, "up", ns=self.bridge_ns)

    def pids(self, host: str) -> list[int]:
        """The processes running in ``host``'s namespace."""
        out = _ip("netns", "pids", self.ns(host), check=False)
        return [int(p) for p in out.stdout.split()]

    def close(self) -> None:
        for host in self.names:
            for pid in self.pids(host):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for proc in self.sshd.values():
            proc.wait(timeout=10)
        for host in self.names:
            _ip("netns", "del", self.ns(host), check=False)
        _ip("netns", "del", self.bridge_ns, check=False)
        shutil.rmtree(self.folder, ignore_errors=True)


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
