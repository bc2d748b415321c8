"""The private network: a holder's namespace has only loopback, a joined process listens there
and nowhere the notebook can reach; ipc socket names; the fallback when namespaces are refused."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nbdist.kernel import netns as kernel_netns
from nbdist.kernel.netns import MODE_ENV, PrivateNetwork

JOIN_AND_LISTEN = """
import os, socket, sys
from nbdist.engine import netns
netns.join_from_env()
s = socket.socket(socket.AF_INET6)
s.bind(("::", 0))  # every interface, as TensorFlow's gRPC server binds
s.listen()
print(s.getsockname()[1], os.readlink("/proc/self/ns/net"), flush=True)
sys.stdin.read()
"""


def _interfaces(pid: int) -> list[str]:
    with open(f"/proc/{pid}/net/dev") as f:
        return [line.split(":")[0].strip() for line in f.readlines()[2:]]


@pytest.fixture
def network(tmp_path):
    net = PrivateNetwork(tmp_path / "nbdist-1-x.ipc")
    yield net
    net.stop()


def _modes() -> list[str]:
    return ["net", "user"] if os.geteuid() == 0 else ["user"]


@pytest.mark.parametrize("mode", _modes())
def test_joined_process_listens_only_on_the_private_loopback(network, monkeypatch, mode):
    if mode == "user":  # what an unprivileged user gets; root can take that path too
        monkeypatch.setattr(kernel_netns.os, "geteuid", lambda: 1000)
    network.start()
    network.ready()
    assert network.reason is None and network.private
    assert network.user == (mode == "user")
    holder = network.holder.pid
    assert _interfaces(holder) == ["lo"]
    assert os.readlink(f"/proc/{holder}/ns/net") != os.readlink("/proc/self/ns/net")
    env = {**os.environ, **network.engine_env()}
    child = subprocess.Popen(
        [sys.executable, "-c", JOIN_AND_LISTEN],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port, ns = child.stdout.readline().split()
        assert ns == os.readlink(f"/proc/{holder}/ns/net")
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.1", int(port))) == errno.ECONNREFUSED
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    assert child.returncode == 0


def test_holder_outlives_an_interrupt_of_the_kernels_process_group(network):
    """Jupyter interrupts a kernel with SIGINT to its process group; the holder is not in it,
    and ignores SIGINT anyway."""
    import signal
    import time

    network.start()
    network.ready()
    holder = network.holder
    assert os.getpgid(holder.pid) != os.getpgid(0)
    os.kill(holder.pid, signal.SIGINT)
    time.sleep(0.3)
    assert holder.poll() is None


def test_holder_exits_when_stopped(network):
    network.start()
    network.ready()
    holder, sockets = network.holder, network.sockets
    network.stop()
    assert holder.returncode == 0
    assert not sockets.exists()


def test_host_network_when_asked(network, monkeypatch):
    monkeypatch.setenv(MODE_ENV, "host")
    network.start()
    network.ready()
    assert not network.private
    assert network.reason == "NBDIST_ENGINE_NETWORK=host is set"
    assert network.engine_env() == {}
    assert network.sockets.is_dir()  # the controller still uses ipc sockets in it


@pytest.mark.parametrize("euid", [0, 1000])
def test_refused_namespaces_fall_back_with_the_reason(network, monkeypatch, euid):
    """A platform that refuses unshare (seccomp, no user namespaces): the holder says why; root
    tries a plain network namespace first, then a user+network one."""
    monkeypatch.setattr(kernel_netns.os, "geteuid", lambda: euid)
    monkeypatch.setattr(kernel_netns.sys, "executable", str(_refusing_python(network)))
    network.start()
    network.ready()
    assert not network.private
    tried = "user+network namespace: unshare: Operation not permitted"
    if euid == 0:
        tried = f"network namespace: unshare: Operation not permitted; {tried}"
    # In words, from the errno (EPERM), then what the holder said.
    assert network.reason == (
        "the platform refuses new namespaces to this process (a container's seccomp profile, as "
        "Docker's default; AppArmor's rule for unprivileged user namespaces, as on Ubuntu 24.04; "
        f"or user namespaces turned off for unprivileged users) ({tried})"
    )
    assert network.holder is None and network.engine_env() == {}


def _refusing_python(network) -> Path:
    """A Python whose unshare() fails with EPERM, as on a platform that forbids namespaces: it
    runs the real holder file, with only ``unshare`` replaced."""
    folder = network._sockets.parent
    (folder / "refuse.py").write_text(
        "import errno, importlib.util, sys\n"
        "path, mode = [a for a in sys.argv[1:] if a not in ('-I', '-S')]\n"
        "spec = importlib.util.spec_from_file_location('netns', path)\n"
        "netns = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(netns)\n"
        "def refuse(*, user):\n"
        "    raise OSError(errno.EPERM, 'unshare: Operation not permitted')\n"
        "netns.unshare = refuse\n"
        "netns.hold(mode)\n"
    )
    script = folder / "python"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {folder / "refuse.py"} "$@"\n')
    script.chmod(0o755)
    return script


def test_a_holder_that_never_answers_is_given_up_on(network, monkeypatch):
    """A holder stuck before it can say anything (here: a Python that only sleeps) is killed
    after HOLDER_START_TIMEOUT_S, and the reason names the wait."""
    folder = network._sockets.parent
    script = folder / "python"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import time; time.sleep(60)'\n")
    script.chmod(0o755)
    monkeypatch.setattr(kernel_netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(kernel_netns.sys, "executable", str(script))
    monkeypatch.setattr(kernel_netns, "HOLDER_START_TIMEOUT_S", 0.5)
    network.start()
    holder = network.holder
    network.ready()
    assert network.reason == (
        "this platform refused a private network (user+network namespace: no answer in 0.5 s)"
    )
    assert not network.private and holder.returncode == -9


def _boot(env: dict[str, str]) -> subprocess.CompletedProcess:
    """An engine's boot in a process of its own, as the engine launcher starts it."""
    return subprocess.run(
        [sys.executable, "-m", "nbdist.engine.boot"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_engine_that_cannot_enter_the_namespace_exits():
    """setns refused by the kernel (here: joining the user namespace it is already in, EINVAL):
    the engine says which call failed and exits before it registers."""
    env = {**os.environ, "NBDIST_NETNS_PID": str(os.getpid()), "NBDIST_NETNS_USER": "1",
           "NBDIST_PRELOAD": ""}  # fmt: skip
    out = _boot(env)
    assert out.returncode == 1
    assert out.stderr == (
        "nbdist: engine could not join the cluster's private network: [Errno 22] "
        f"setns(user namespace of process {os.getpid()}): Invalid argument\n"
    )


def test_engine_that_cannot_join_exits(tmp_path):
    env = {**os.environ, "NBDIST_NETNS_PID": "999999999", "NBDIST_PRELOAD": ""}
    out = _boot(env)
    assert out.returncode == 1
    assert out.stderr.startswith(
        "nbdist: engine could not join the cluster's private network: [Errno 2]"
    )


def test_link_names_each_bound_socket_as_ipyparallel_connects(network, tmp_path):
    network.start()
    network.ready()
    info = tmp_path / "ipcontroller-engine.json"
    info.write_text(
        json.dumps({"interface": "ipc:///x/s", "registration": 101, "broadcast": [102, 103]})
    )
    network.link([str(info)])
    network.link([str(info)])  # a second call (replaced engines) is harmless
    links = {p.name: os.readlink(p) for p in network.sockets.iterdir()}
    assert links == {"s:101": "s-101", "s:102": "s-102", "s:103": "s-103"}
    assert network.controller_args() == [
        "--IPController.transport=ipc",
        f"--IPController.ip={network.sockets / 's'}",
    ]
    assert oct(network.sockets.stat().st_mode & 0o777) == "0o700"


def _controller(tmp_path, code: str):
    from ipyparallel.cluster.launcher import LocalControllerLauncher

    launcher = LocalControllerLauncher(
        controller_cmd=[sys.executable, "-c", code], profile_dir=str(tmp_path), cluster_id="t"
    )
    launcher.start()
    return launcher


def test_wait_for_files_reports_a_controller_that_exits(tmp_path):
    from nbdist import ClusterError
    from nbdist.kernel.netns import wait_for_files

    launcher = _controller(tmp_path, "raise SystemExit(3)")
    with pytest.raises(ClusterError, match="^the ipyparallel controller exited while starting$"):
        wait_for_files(launcher, 30)


def test_wait_for_files_gives_up(tmp_path):
    from nbdist import ClusterError
    from nbdist.kernel.netns import wait_for_files

    launcher = _controller(tmp_path, "import time; time.sleep(60)")
    security = tmp_path / "security"
    try:
        with pytest.raises(ClusterError, match="wrote no connection file within 1 s$"):
            wait_for_files(launcher, 1)
        # A file that is there but not yet written (the controller writes in place) is not
        # ready either.
        security.mkdir(exist_ok=True)
        (security / "ipcontroller-t-client.json").write_text("")
        (security / "ipcontroller-t-engine.json").write_text("{}")
        with pytest.raises(ClusterError, match="wrote no connection file within 1 s$"):
            wait_for_files(launcher, 1)
    finally:
        launcher.signal(9)
        launcher.process.wait()
    security.mkdir(exist_ok=True)
    for kind in ("client", "engine"):
        (security / f"ipcontroller-t-{kind}.json").write_text("{}")
    assert wait_for_files(launcher, 1) == [
        str(security / "ipcontroller-t-client.json"),
        str(security / "ipcontroller-t-engine.json"),
    ]


UNPRIVILEGED = """
import errno, os, socket, subprocess, sys
path = sys.argv[1]
holder = subprocess.Popen(
    [sys.executable, "-I", "-S", path, "user"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
said = holder.stdout.readline().strip()
ifaces = [l.split(":")[0].strip() for l in open(f"/proc/{holder.pid}/net/dev").readlines()[2:]]
code = f'''
import importlib.util, os, socket, sys
spec = importlib.util.spec_from_file_location("netns", {path!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
m.join({holder.pid}, m.proc_stat({holder.pid})[1], user=True)
s = socket.socket(socket.AF_INET6)
s.bind(("::", 0))
s.listen()
print(s.getsockname()[1], os.getuid(), os.readlink("/proc/self/ns/net"), flush=True)
sys.stdin.read()
'''
child = subprocess.Popen(
    [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
port, uid, ns = child.stdout.readline().split()
with socket.socket() as s:
    refused = errno.errorcode.get(s.connect_ex(("127.0.0.1", int(port))))
child.stdin.close()
child.wait()
holder.stdin.close()
holder.wait()
outside = ns != os.readlink("/proc/self/ns/net")
print(said, ifaces, os.getuid(), int(uid), outside, refused, holder.returncode)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
    reason="needs root and setpriv to run as another, unprivileged uid",
)
def test_unprivileged_user_gets_a_private_network():
    """As uid 4242 with no capabilities: the holder makes a user+network namespace, a process
    joins it keeping its uid, and what it listens on is refused from the namespace outside. The
    system Python runs it: the holder and the join use only the standard library."""
    import shutil
    import tempfile

    from nbdist.engine import netns

    # A copy uid 4242 can read: the checkout may sit in a folder only its owner can enter
    # (a clone under mktemp -d, say).
    folder = tempfile.mkdtemp()
    try:
        os.chmod(folder, 0o755)
        script = shutil.copy(netns.__file__, os.path.join(folder, "netns.py"))
        os.chmod(script, 0o644)
        out = subprocess.run(
            ["/usr/bin/setpriv", "--reuid=4242", "--regid=4242", "--clear-groups",
             "/usr/bin/python3", "-c", UNPRIVILEGED, script],
            capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
    finally:
        shutil.rmtree(folder)
    assert out.stdout == "ready ['lo'] 4242 4242 True ECONNREFUSED 0\n", out.stderr


def test_the_refusal_is_worded_from_the_errno():
    from nbdist.kernel.netns import refusal

    assert refusal([("user", f"{errno.ENOSPC} No space left on device")]) == (
        "user namespaces are disabled on this machine (user.max_user_namespaces is 0) "
        "(user+network namespace: No space left on device)"
    )
    assert refusal([("user", "no answer in 10 s")]) == (
        "this platform refused a private network (user+network namespace: no answer in 10 s)"
    )


def test_network_namespaces_are_linux_only(network, monkeypatch):
    monkeypatch.setattr(kernel_netns.sys, "platform", "darwin")
    network.start()
    network.ready()
    assert network.reason == "network namespaces are Linux-only (this is darwin)"
    assert network.holder is None and network.engine_env() == {}


def test_host_network_when_the_start_asks(network):
    network.start("host")
    network.ready()
    assert network.reason == "--network host was asked for" and not network.private


def test_a_holder_whose_pid_names_another_process_now_is_not_joined(network):
    """The holder is named by its PID and its start: a process that has the PID now (the
    holder died, its PID was taken) is another process, and the engine exits instead."""
    network.start()
    network.ready()
    pid, started = network.engine_env()["NBDIST_NETNS_PID"].split(":")
    assert int(started) == network.started
    env = {**os.environ, "NBDIST_NETNS_PID": f"{pid}:{int(started) + 1}", "NBDIST_PRELOAD": "",
           "NBDIST_NETNS_USER": network.engine_env()["NBDIST_NETNS_USER"]}  # fmt: skip
    out = _boot(env)
    assert out.returncode == 1
    assert out.stderr == (
        "nbdist: engine could not join the cluster's private network: [Errno 3] the cluster's "
        f"namespace holder (process {pid}) is gone; its PID now names another process\n"
    )
