"""Where users are: a container that refuses namespaces (a real seccomp filter), one that lets a
process make a namespace but not join one, a notebook folder with a profile.py, one GPU for two
workers, and the workers' network (an outbound-only link, or none)."""

from __future__ import annotations

import errno
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests import seccomp

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

# A notebook's kernel, in a process of its own (under a seccomp filter, say): start two workers,
# run a cell, stop; what it printed and how long the start took.
KERNEL = textwrap.dedent(
    """
    import os, time
    os.environ["NBDIST_PRESTART"] = "0"
    from IPython.testing.globalipapp import start_ipython
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    start = time.monotonic()
    try:
        ip.run_line_magic("distrain", "start -n 2")
    except Exception as e:
        print("START FAILED", type(e).__name__, e)
    print(f"START TOOK {time.monotonic() - start:.1f}")
    if ip.magics_manager.registry["DistrainMagics"].cluster.running:
        cell = os.environ.get("NBDIST_TEST_CELL", "dist.get_world_size()")
        ip.run_cell_magic("distrain", "-o res --no-plot", cell + "\\n")
        print("VALUES", ip.user_ns["res"].values)
    ip.run_line_magic("unload_ext", "nbdist")
    """
)


def _kernel(preexec=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-c", KERNEL],
        preexec_fn=preexec,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(not seccomp.available(), reason="the seccomp filter is written for x86_64")
@pytest.mark.parametrize(
    ("err", "cause"),
    [
        (errno.EPERM, "the platform refuses new namespaces to this process (a container's "
                      "seccomp profile, as Docker's default"),
        (errno.ENOSPC, "user namespaces are disabled on this machine (user.max_user_namespaces "
                       "is 0)"),
    ],
    ids=["docker-seccomp", "no-user-namespaces"],
)  # fmt: skip
def test_a_platform_that_refuses_namespaces_runs_on_the_host_network_and_says_why(err, cause):
    out = _kernel(seccomp.refusing("unshare", err=err))
    assert "VALUES [2, 2]" in out.stdout, out.stdout + out.stderr
    notice = next(line for line in out.stdout.splitlines() if "share this machine's" in line)
    assert notice.startswith(
        "nbdist: the workers share this machine's network, so other users of it can reach "
        f"their ports ({cause}"
    ), notice
    assert notice.endswith("); %distrain status says more"), notice


@pytest.mark.skipif(not seccomp.available(), reason="the seccomp filter is written for x86_64")
def test_an_engine_that_cannot_join_fails_the_start_at_once_with_its_own_error():
    """setns refused (unshare allowed): the holder makes the namespace, every engine exits at
    boot. The start fails within seconds, quoting the engine, instead of waiting 120 s."""
    out = _kernel(seccomp.refusing("setns"))
    assert "START FAILED ClusterError could not start 2 local engines: an engine exited while " \
           "starting (exited with status 1" in out.stdout, out.stdout + out.stderr  # fmt: skip
    assert (
        "    nbdist: engine could not join the cluster's private network: [Errno 1] "
        "setns(net namespace of process"
        in out.stdout
        or "    nbdist: engine could not join the cluster's private network: [Errno 1] "
        "setns(user namespace of process"
        in out.stdout
    ), out.stdout
    took = float(out.stdout.split("START TOOK ")[1].split()[0])
    assert took < 30, out.stdout


def test_a_profile_py_in_the_notebooks_folder_does_not_stop_the_workers(
    shell, magics, tmp_path, monkeypatch
):
    """Engines start in the notebook's folder: a profile.py there hid the standard library's
    from IPython, and every engine died starting. The folder's own modules still import."""
    (tmp_path / "profile.py").write_text("raise SystemExit('the standard profile was hidden')\n")
    monkeypatch.chdir(tmp_path)
    shell.run_line_magic("distrain", "restart -n 2")
    try:
        (tmp_path / "mymod.py").write_text("ANSWER = 42\n")  # written after the start
        shell.run_cell_magic("distrain", "-o res --no-plot", "import mymod\nmymod.ANSWER\n")
        assert shell.user_ns["res"].values == [42, 42]
    finally:
        shell.run_line_magic("distrain", "stop")


def test_one_gpu_for_two_workers_runs_them_on_the_cpu(shell, magics, monkeypatch, capsys):
    """Colab: one GPU, and every tutorial's -n 2. Here CUDA_VISIBLE_DEVICES shows the GPU list a
    one-GPU machine has; the workers see none, and use gloo on the CPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    shell.run_line_magic("distrain", "restart -n 2")
    try:
        out = capsys.readouterr().out
        assert (
            "nbdist: 2 workers for 1 GPU: the workers use the CPU (gloo), since with nccl each "
            "needs a GPU of its own; -n 1 puts one on the GPU.\n" in out
        )
        cell = "import os\n(str(device), dist.get_backend(), os.environ['CUDA_VISIBLE_DEVICES'])\n"
        shell.run_cell_magic("distrain", "-o res --no-plot", cell)
        assert shell.user_ns["res"].values == [("cpu", "gloo", "")] * 2
    finally:
        shell.run_line_magic("distrain", "stop")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _host_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


@pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="slirp4netns is not installed")
def test_the_private_network_connects_out_and_nothing_connects_in(shell, magics, capsys, tmp_path):
    address = _host_address()
    if address is None:
        pytest.skip("this machine has no address besides loopback")
    (tmp_path / "data.txt").write_text("served\n")
    server = http.server.ThreadingHTTPServer((address, 0), _handler(tmp_path))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    shell.run_line_magic("distrain", "restart -n 2 --network private")
    try:
        out = capsys.readouterr().out
        # One plain sentence at the start, nothing of TensorFlow; the detail in the status.
        assert (
            "nbdist: the workers have a private network: they can connect out, nothing can "
            "connect in; %distrain status says more\n" in out
        ), out
        shell.run_line_magic("distrain", "status")
        assert (
            "network: private, outbound connections only (slirp4netns: nothing outside can "
            "connect in): a network namespace of their own; it keeps the ports of torch's store "
            "and gloo, and TensorFlow's servers (which run any code sent to them), to the "
            "workers" in capsys.readouterr().out
        )
        cell = textwrap.dedent(
            f"""
            import socket, urllib.request
            text = urllib.request.urlopen("http://{address}:{server.server_port}/data.txt",
                                          timeout=10).read().decode()
            listener = socket.socket()
            listener.bind(("0.0.0.0", 0))   # every interface, as TensorFlow's servers bind
            listener.listen()
            (text, listener.getsockname()[1])
            """
        )
        shell.run_cell_magic("distrain", "-o res --no-plot", cell)
        (text, port), _ = shell.user_ns["res"].values
        assert text == "served\n"
        for target in ("127.0.0.1", address, "10.0.2.100"):
            with socket_to(target, port) as refused:
                assert refused, f"{target}:{port} reached a worker's listener"
    finally:
        server.shutdown()
        server.server_close()  # shutdown() only ends serve_forever: the socket listened on
        shell.run_line_magic("distrain", "stop")


def _handler(folder):
    class Handler(_Quiet):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

    return Handler


class socket_to:
    """``with socket_to(host, port) as refused``: whether a connection there fails."""

    def __init__(self, host, port):
        import socket

        self.sock = socket.socket()
        self.sock.settimeout(2)
        self.target = (host, port)

    def __enter__(self):
        try:
            self.sock.connect(self.target)
        except OSError:
            return True
        return False

    def __exit__(self, *exc):
        self.sock.close()


def test_a_download_in_an_isolated_network_says_where_the_workers_are(shell, magics):
    from nbdist import WorkerError

    shell.run_line_magic("distrain", "restart -n 2 --network isolated")
    try:
        cell = "import socket\nsocket.getaddrinfo('pypi.org', 443)\n"
        with pytest.raises(WorkerError) as info:
            shell.run_cell_magic("distrain", "--no-plot", cell)
        rendered = info.value._render_traceback_()
        # The cause's note, then where to look further, then what became of the variables.
        assert rendered[-3:-1] == [
            "The workers run in a network of their own with no way out: download in a "
            "notebook cell (the workers see the notebook's files), or restart them on this "
            "machine's network: %distrain restart --network host.",
            "To look at rank 0's variables where it raised: %distrain debug",
        ]
    finally:
        shell.run_line_magic("distrain", "stop")
        shell.run_line_magic("distrain", "restart -n 2 --network private")
        shell.run_line_magic("distrain", "stop")


def test_a_cluster_runs_as_an_unprivileged_user():
    """Everything as uid 4242 with no capabilities: the private network is a user namespace,
    the run files are that user's, a DDP cell trains, and the stop leaves nothing."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to become another user) and setpriv")
    home = Path(tempfile.mkdtemp(prefix="nbdist-user-"))  # a folder uid 4242 can reach
    os.chown(home, 4242, 4242)
    readable = _make_readable_by_others()
    cell = (
        "model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))\n"
        "import os, socket\n"
        "(dist.get_world_size(), os.getuid(),"
        " {name for _, name in socket.if_nameindex()} <= {'lo', 'tap0'})"
    )
    env = {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": "", "IPYTHONDIR": str(home / ".ip"),
           "MPLCONFIGDIR": str(home / ".mpl"), "NBDIST_TEST_CELL": cell}  # fmt: skip
    try:
        out = subprocess.run(
            ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "--inh-caps=-all",
             sys.executable, "-c", KERNEL],
            capture_output=True, text=True, timeout=240, cwd=str(home), env=env,
        )  # fmt: skip
    finally:
        readable()
        shutil.rmtree(home, ignore_errors=True)
    assert "VALUES [(2, 4242, True), (2, 4242, True)]" in out.stdout, out.stdout + out.stderr
    assert "the workers have a private network" in out.stdout
    assert _running_as(4242, within=10) == []


def _running_as(uid: int, within: float) -> list[str]:
    """The processes of ``uid`` still running (zombies waiting to be reaped do not count) once
    ``within`` seconds have passed, or as soon as there are none."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for p in psutil.process_iter(["uids", "status", "cmdline"]):
            uids, status = p.info["uids"], p.info["status"]
            if uids and uids.real == uid and status != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {status} {' '.join(p.info['cmdline'] or [])}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _make_readable_by_others():
    """Let uid 4242 reach this checkout, its venv and the Python it was made from (a clone under
    ``mktemp -d`` sits in a folder only its owner can enter, pyenv's Pythons under /root);
    returns what puts the modes back."""
    changed = []
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [sys.prefix, here, sys.base_prefix, os.path.realpath(sys.executable)]
    for path in paths:
        path = os.path.realpath(path)
        while path != "/":
            mode = os.stat(path).st_mode & 0o7777
            if mode & 0o005 != 0o005:
                os.chmod(path, mode | 0o005)
                changed.append((path, mode))
            path = os.path.dirname(path)

    def restore():
        for path, mode in reversed(changed):
            os.chmod(path, mode)

    return restore
