"""The local cluster's private network: engines in one loopback-only network namespace.

TensorFlow's gRPC servers (one per MultiWorkerMirroredStrategy worker) bind every interface and
run whatever any client sends them. No TensorFlow option binds them to an address, so nbdist
puts the engines where "every interface" means only a private loopback:

* A *holder* process (:func:`nbdist.engine.netns.hold`, a child of the kernel) creates a network
  namespace, brings its ``lo`` up and waits. As root it needs only ``unshare(CLONE_NEWNET)``;
  any other user gets an unprivileged user namespace around it (keeping its own uid and gid).
  It exits when the kernel closes its stdin (on stop, or when the kernel dies).
* Each engine joins that namespace first thing (:mod:`nbdist.engine.netns`, from
  ``nbdist.engine.boot``), so all ranks share one loopback: gloo, the TCPStore and TF's gRPC
  reach each other there, and nothing in it is reachable from the notebook's namespace or any
  other host. PIDs are not namespaced: kill, interrupt and CPU accounting by PID still work.
* The controller talks to engines and to this kernel over ZeroMQ ``ipc://`` sockets (filesystem
  paths cross network namespaces) in a 0700 folder, so no other local user can connect either.
  ipyparallel 9.2 binds an ipc endpoint as ``PATH-PORT`` but connects to ``PATH:PORT``;
  :meth:`PrivateNetwork.link` adds the ``PATH:PORT`` names as symlinks to the bound sockets.

Where the platform refuses namespaces (no user namespaces for unprivileged users, a seccomp
profile), or ``NBDIST_ENGINE_NETWORK=host`` asks for it, engines share the host's network as
before; :attr:`PrivateNetwork.reason` says why, and a multi-worker TensorFlow job then needs
``--expose-tf`` (see :func:`nbdist.kernel.exposure.tf_exposure`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from nbdist.engine import netns
from nbdist.errors import ClusterError

log = logging.getLogger(__name__)

MODE_ENV = "NBDIST_ENGINE_NETWORK"  # "private" (default) or "host"
HOLDER_START_TIMEOUT_S = 10
OUTBOUND_START_TIMEOUT_S = 5
SOCKET_BASE = "s"  # short: a unix socket path has at most 107 bytes


class PrivateNetwork:
    """One local cluster's namespace holder and ipc socket folder (see the module docstring)."""

    def __init__(self, sockets: Path) -> None:
        self._sockets = sockets
        self.holder: subprocess.Popen | None = None
        self.user = False
        self.sockets: Path | None = None
        self.reason: str | None = None  # why engines share the host's network (None: they don't)
        self._modes: list[str] = []  # kinds of namespace still to try, the running holder's first
        self._tried: list[tuple[str, str]] = []  # each failed kind, and what it said
        self.started: int | None = None  # the holder's start in ticks (with its PID, who it is)
        self.outbound: subprocess.Popen | None = None  # slirp4netns, when it links the network
        self.isolated = False  # asked for no outbound link
        self._outbound_exit: int | None = None  # its exit pipe: closed, it exits

    @property
    def private(self) -> bool:
        return self.holder is not None

    def start(self, mode: str | None = None) -> None:
        """Start the holder; :meth:`ready` waits for it (the controller starts meanwhile).
        ``mode``: one of ``MODES`` (``%distrain start --network``; None:
        ``$NBDIST_ENGINE_NETWORK``, else private)."""
        self._sockets.mkdir(mode=0o700)
        self.sockets = self._sockets
        self.isolated = (mode or os.environ.get(MODE_ENV, "private")) == "isolated"
        self.reason = host_network_asked(mode)
        if self.reason is not None:
            return
        if not sys.platform.startswith("linux"):
            self.reason = f"network namespaces are Linux-only (this is {sys.platform})"
            return
        self._modes = ["net", "user"] if os.geteuid() == 0 else ["user"]
        self._tried = []
        self._launch()

    def _launch(self) -> None:
        self.holder = subprocess.Popen(
            [sys.executable, "-I", "-S", netns.__file__, self._modes[0]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            # Jupyter interrupts a kernel by SIGINT to its whole process group (the Stop
            # button, Kernel > Interrupt): the holder must outlive that, or replacement engines
            # have no namespace to join. It still goes when the kernel does (stdin closes).
            start_new_session=True,
        )

    def ready(self) -> None:
        """Wait for the holder; on failure try the next kind of namespace, and at the end leave
        engines on the host's network (``reason`` says why)."""
        while self.holder is not None:
            holder = self.holder
            try:
                line = _first_line(holder, HOLDER_START_TIMEOUT_S)
            except TimeoutError:
                line = f"no answer in {HOLDER_START_TIMEOUT_S} s"
            if line == "ready":
                self.user = self._modes[0] == "user"
                stat_ = netns.proc_stat(holder.pid)
                self.started = None if stat_ is None else stat_[1]
                return
            holder.kill()
            holder.wait()
            _pipe(holder.stdout).close()
            _pipe(holder.stdin).close()
            mode = self._modes.pop(0)
            self._tried.append((mode, line))
            self.holder = None
            if self._modes:
                self._launch()
        if self.reason is None:
            self.reason = refusal(self._tried)
            log.info("engines use the host network: %s", self.reason)

    def link_out(self) -> None:
        """Give the private network an outbound-only link, when ``slirp4netns`` is installed:
        a NAT in user space (no privilege needed), through which the workers connect out
        (downloads, model hubs) and nothing connects in (no port is forwarded; the host's own
        loopback is left out, ``--disable-host-loopback``). It exits when the kernel does (its
        exit pipe closes). Without it the network has its loopback only (``outbound`` says)."""
        tool = shutil.which("slirp4netns")
        if self.holder is None or tool is None or self.isolated:
            return
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        pid = self.holder.pid
        args = [tool, "--configure", "--mtu=65520", "--disable-host-loopback",
                f"--ready-fd={ready_w}", f"--exit-fd={exit_r}"]  # fmt: skip
        if self.user:
            args.append(f"--userns-path=/proc/{pid}/ns/user")
        proc = subprocess.Popen(
            [*args, str(pid), "tap0"],
            pass_fds=(ready_w, exit_r),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # as the holder: not stopped by the kernel's interrupt
        )
        os.close(ready_w)
        os.close(exit_r)
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(ready_r, selectors.EVENT_READ)
            ready = bool(sel.select(OUTBOUND_START_TIMEOUT_S)) and os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        if not ready:
            os.close(exit_w)
            proc.kill()
            said = proc.communicate()[1].decode(errors="replace").strip().splitlines()
            log.info("no outbound link: %s", said[-1] if said else "slirp4netns did not start")
            return
        _pipe(proc.stderr).close()
        self.outbound, self._outbound_exit = proc, exit_w

    def describe(self) -> str:
        """The start notice's one line: what network the workers have, in plain words (the
        details are :meth:`details`, in ``%distrain status``)."""
        if not self.private:
            return (
                f"nbdist: the workers share this machine's network, so other users of it can "
                f"reach their ports ({self.reason}); %distrain status says more"
            )
        if self.outbound is None:
            return (
                "nbdist: the workers have a private network with no way out: download data in "
                "the notebook (the workers see its files); %distrain status says more"
            )
        return (
            "nbdist: the workers have a private network: they can connect out, nothing can "
            "connect in; %distrain status says more"
        )

    def details(self) -> str:
        """``%distrain status``'s line on the network: what it keeps out, and why."""
        if not self.private:
            return (
                f"network: this machine's ({self.reason}): other local users can reach the "
                "workers' torch store and gloo ports on 127.0.0.1, and multi-worker TensorFlow "
                "jobs need --expose-tf"
            )
        why = (
            "a network namespace of their own; it keeps the ports of torch's store and gloo, and "
            "TensorFlow's servers (which run any code sent to them), to the workers"
        )
        if self.outbound is None:
            how = (
                "--network isolated"
                if self.isolated
                else "slirp4netns is not installed (it gives outbound connections)"
            )
            return (
                f"network: private, no way out ({how}): {why}; %distrain restart --network host "
                "gives them this machine's"
            )
        names = (
            ""
            if resolver_reachable()
            else (
                "; names do not resolve there (this machine's resolver listens on its own "
                "loopback: /etc/resolv.conf)"
            )
        )
        return (
            f"network: private, outbound connections only (slirp4netns: nothing outside can "
            f"connect in): {why}{names}"
        )

    def controller_args(self) -> list[str]:
        """ipcontroller options: every socket an ipc endpoint in the private folder."""
        assert self.sockets is not None
        return ["--IPController.transport=ipc", f"--IPController.ip={self.sockets / SOCKET_BASE}"]

    def engine_env(self) -> dict[str, str]:
        if self.holder is None:
            return {}
        env = {
            netns.HOLDER_ENV: f"{self.holder.pid}:{self.started}",
            netns.USER_NS_ENV: "1" if self.user else "",
        }
        if "TORCH_CPP_LOG_LEVEL" not in os.environ:
            # c10d names each TCPStore client socket (::ffff:127.0.0.1) by reverse DNS; with no
            # DNS server reachable that fails with EAI_AGAIN, not "no name", and c10d prints a
            # warning into the cell for every new rendezvous. Its errors still show.
            env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        return env

    def link(self, connection_files: Iterable[str]) -> None:
        """Name each bound ``s-PORT`` socket also ``s:PORT``, the name ipyparallel connects to."""
        assert self.sockets is not None
        for path in connection_files:
            with open(path) as f:
                info = json.load(f)
            for value in info.values():
                for port in value if isinstance(value, list) else [value]:
                    if isinstance(port, int) and not isinstance(port, bool):
                        link = self.sockets / f"{SOCKET_BASE}:{port}"
                        if not os.path.lexists(link):
                            os.symlink(f"{SOCKET_BASE}-{port}", link)

    def stop(self) -> None:
        outbound, self.outbound = self.outbound, None
        if outbound is not None:
            if self._outbound_exit is not None:
                os.close(self._outbound_exit)
            try:
                outbound.wait(timeout=2)
            except subprocess.TimeoutExpired:
                outbound.kill()
                outbound.wait()
        holder, self.holder = self.holder, None
        if holder is not None:
            with contextlib.suppress(OSError):
                _pipe(holder.stdin).close()
            try:
                holder.wait(timeout=2)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
            _pipe(holder.stdout).close()
        sockets, self.sockets = self.sockets, None
        if sockets is not None:
            for entry in sockets.iterdir():
                with contextlib.suppress(OSError):
                    entry.unlink()
            with contextlib.suppress(OSError):
                sockets.rmdir()


# private: a network of the workers' own, with an outbound-only link where slirp4netns is
# installed; isolated: the same without the link (loopback only); host: this machine's.
MODES = ("private", "isolated", "host")


def host_network_asked(mode: str | None = None) -> str | None:
    """Why engines started now will share the host's network, when asked to (``mode``
    "host": ``%distrain start --network host``; or ``NBDIST_ENGINE_NETWORK=host``); None
    otherwise. A platform that refuses namespaces is found only by starting the holder
    (:meth:`PrivateNetwork.ready`)."""
    if mode == "host":
        return "--network host was asked for"
    if mode is None and os.environ.get(MODE_ENV, "private") == "host":
        return f"{MODE_ENV}=host is set"
    return None


# What an errno from unshare() means, in words (man 2 unshare, and what platforms do).
_REFUSALS = {
    errno.EPERM: "the platform refuses new namespaces to this process (a container's seccomp "
    "profile, as Docker's default; AppArmor's rule for unprivileged user namespaces, as on "
    "Ubuntu 24.04; or user namespaces turned off for unprivileged users)",
    errno.EACCES: "the platform refuses new namespaces to this process (a security module "
    "such as AppArmor or SELinux)",
    errno.ENOSPC: "user namespaces are disabled on this machine (user.max_user_namespaces is 0)",
    errno.EUSERS: "user namespaces are disabled on this machine (user.max_user_namespaces is 0)",
    errno.EINVAL: "this kernel was built without network or user namespaces",
    errno.ENOSYS: "this kernel was built without network or user namespaces",
}


def refusal(tried: list[tuple[str, str]]) -> str:
    """Why no namespace could be made, in words, from what each kind the holder tried said
    (``"<errno> <message>"``, or what went wrong with it), the raw messages after it."""
    causes, raw = [], []
    for mode, line in tried:
        number, _, message = line.partition(" ")
        words = _REFUSALS.get(int(number)) if number.isdigit() else None
        if words and words not in causes:
            causes.append(words)
        kind = "user+network namespace" if mode == "user" else "network namespace"
        raw.append(f"{kind}: {message if number.isdigit() else line}")
    lead = causes[-1] if causes else "this platform refused a private network"
    return f"{lead} ({'; '.join(raw)})"


def resolver_reachable(path: str = "/etc/resolv.conf") -> bool:
    """Whether a name server this machine uses is reachable from the private network: one that
    is not on loopback (systemd-resolved's 127.0.0.53 is this machine's own loopback, which the
    outbound link leaves out)."""
    import ipaddress

    try:
        with open(path) as f:
            servers = [
                ln.split()[1] for ln in f if ln.startswith("nameserver") and len(ln.split()) > 1
            ]
    except OSError:
        return False
    for server in servers:
        try:
            if not ipaddress.ip_address(server.split("%")[0]).is_loopback:
                return True
        except ValueError:
            continue
    return False


def wait_for_files(controller: Any, timeout: float) -> list[str]:
    """The controller's connection files, once it has written them: each there and whole (the
    controller writes them in place, and a file read as soon as it existed was once empty: a
    clean-clone run's start failed on its JSON)."""
    files = list(controller.connection_files.values())
    deadline = time.monotonic() + timeout
    while not all(_written(f) for f in files):
        if controller.poll() is not None:
            raise ClusterError("the ipyparallel controller exited while starting")
        if time.monotonic() > deadline:
            raise ClusterError(
                f"the ipyparallel controller wrote no connection file within {timeout:.0f} s"
            )
        time.sleep(0.02)
    return files


def _written(path: str) -> bool:
    """Whether ``path`` holds a whole JSON object."""
    try:
        with open(path) as f:
            return isinstance(json.load(f), dict)
    except (OSError, ValueError):
        return False


def _pipe(stream: IO[Any] | None) -> IO[Any]:
    """A pipe of a process started with ``subprocess.PIPE`` for it (never None then)."""
    assert stream is not None
    return stream


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    stdout = _pipe(proc.stdout)
    with selectors.DefaultSelector() as sel:
        sel.register(stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError
    return stdout.readline().strip() or f"exited with status {proc.wait()}"
