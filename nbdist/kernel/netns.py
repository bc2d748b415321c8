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
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nbdist.engine import netns
from nbdist.errors import ClusterError

log = logging.getLogger(__name__)

MODE_ENV = "NBDIST_ENGINE_NETWORK"  # "private" (default) or "host"
HOLDER_START_TIMEOUT_S = 10
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
        self._tried: list[str] = []  # what each failed kind said

    @property
    def private(self) -> bool:
        return self.holder is not None

    def start(self) -> None:
        """Start the holder; :meth:`ready` waits for it (the controller starts meanwhile)."""
        self._sockets.mkdir(mode=0o700)
        self.sockets = self._sockets
        self.reason = host_network_asked()
        if self.reason is not None:
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
                return
            holder.kill()
            holder.wait()
            holder.stdout.close()
            holder.stdin.close()
            mode = self._modes.pop(0)
            self._tried.append(f"{'user+' if mode == 'user' else ''}network namespace: {line}")
            self.holder = None
            if self._modes:
                self._launch()
        if self.reason is None:
            self.reason = "this platform refused a private network (" + "; ".join(self._tried) + ")"
            log.info("engines use the host network: %s", self.reason)

    def controller_args(self) -> list[str]:
        """ipcontroller options: every socket an ipc endpoint in the private folder."""
        assert self.sockets is not None
        return ["--IPController.transport=ipc", f"--IPController.ip={self.sockets / SOCKET_BASE}"]

    def engine_env(self) -> dict[str, str]:
        if self.holder is None:
            return {}
        env = {netns.HOLDER_ENV: str(self.holder.pid), netns.USER_NS_ENV: "1" if self.user else ""}
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
        holder, self.holder = self.holder, None
        if holder is not None:
            with contextlib.suppress(OSError):
                holder.stdin.close()
            try:
                holder.wait(timeout=2)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
            holder.stdout.close()
        sockets, self.sockets = self.sockets, None
        if sockets is not None:
            for entry in sockets.iterdir():
                with contextlib.suppress(OSError):
                    entry.unlink()
            with contextlib.suppress(OSError):
                sockets.rmdir()


def host_network_asked() -> str | None:
    """Why engines started now will share the host's network, when the configuration says so
    (``NBDIST_ENGINE_NETWORK=host``); None otherwise. A platform that refuses namespaces is
    found only by starting the holder (:meth:`PrivateNetwork.ready`)."""
    return f"{MODE_ENV}=host is set" if os.environ.get(MODE_ENV, "private") == "host" else None


def wait_for_files(controller: Any, timeout: float) -> list[str]:
    """The controller's connection files, once it has written them."""
    files = list(controller.connection_files.values())
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(f) for f in files):
        if controller.poll() is not None:
            raise ClusterError("the ipyparallel controller exited while starting")
        if time.monotonic() > deadline:
            raise ClusterError(
                f"the ipyparallel controller wrote no connection file within {timeout:.0f} s"
            )
        time.sleep(0.02)
    return files


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError
    return proc.stdout.readline().strip() or f"exited with status {proc.wait()}"
