"""``%load_ext nbdist`` starts the workers in the background; the first cell reuses them.

The notices of the background start are held and shown once, in the first command that needs
the cluster; a failed start shows its error there (and in ``%distrain status``); an interrupt
while the first cell waits for the start leaves a working cluster or none; a kernel shut down
during the start leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil
import pytest

from nbdist import ClusterError
from nbdist.kernel import local as cluster_module
from nbdist.kernel.magic import PRESTART_ENV, DistrainMagics
from tests.procs import no_process_left

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

STARTING = "nbdist: starting 2 workers (local ipyparallel cluster on 127.0.0.1)"


@pytest.fixture
def prestarting(shell, monkeypatch):
    """A DistrainMagics of its own whose ``%load_ext`` would prestart; stopped at the end."""
    monkeypatch.setenv(PRESTART_ENV, "1")
    magics = DistrainMagics(shell)
    yield magics
    magics.close()


def test_first_cell_reuses_the_background_start_and_shows_its_notice_once(prestarting, capsys):
    with no_process_left():
        assert prestarting.start_in_background()
        time.sleep(1)  # the user reads: whatever the start says is held, not printed now
        assert capsys.readouterr().out == ""
        prestarting.distrain(
            "-o res", "import os\nprint('hello from', rank)\n(rank, os.getpid())\n"
        )
        out = capsys.readouterr().out
        assert out.count(STARTING) == 1 and out.startswith(STARTING)
        assert "[rank 0] hello from 0\n" in out and "[rank 1] hello from 1\n" in out
        engines = prestarting.cluster.engines
        assert prestarting.shell.user_ns["res"].values == [(0, engines[0].pid), (1, engines[1].pid)]
        # The engines preloaded torch while they started (TensorFlow stays on demand).
        loaded = "[m in __import__('sys').modules for m in ('torch', 'tensorflow')]"
        assert prestarting.cluster.apply_async(0, eval, loaded).get(10) == [True, False]
        prestarting.distrain("-o res", "rank\n")
        assert STARTING not in capsys.readouterr().out
        prestarting.close()


def test_a_first_cell_with_another_size_resizes(prestarting, capsys):
    with no_process_left():
        prestarting.start_in_background()
        prestarting.distrain("-n 1 -o res", "world_size\n")
        assert prestarting.shell.user_ns["res"].values == [1]
        out = capsys.readouterr().out
        assert out.index(STARTING) < out.index("nbdist: resizing the cluster from 2 to 1 workers")
        prestarting.close()


def test_a_failed_background_start_is_shown_in_status_and_the_first_cell(
    prestarting, monkeypatch, capsys
):
    # Engines that never register: they sleep (a 0.01 s timeout instead raced with engines
    # fast enough to register; engines that exit are reported as such, with their output).
    real = cluster_module._ipp_cluster

    def engines_that_never_register(*args, **kwargs):
        ipp_cluster = real(*args, **kwargs)
        ipp_cluster.config.LocalEngineSetLauncher.engine_cmd = [
            sys.executable, "-c", "import time; time.sleep(120)"
        ]  # fmt: skip
        return ipp_cluster

    monkeypatch.setattr(cluster_module, "_ipp_cluster", engines_that_never_register)
    monkeypatch.setattr(cluster_module, "ENGINE_START_TIMEOUT_S", 1)
    with no_process_left():
        prestarting.start_in_background()
        prestarting.distrain("status")
        out = capsys.readouterr().out
        assert (
            "nbdist: the workers could not be started in the background: could not start 2 "
            "local engines: only 0 of 2 new engines registered within 1 s. A busy machine may "
            "not start them in time: run %distrain start again, or with fewer workers "
            "(%distrain start -n 1)." in out
        )
        assert "nbdist: no cluster running. %distrain start [-n N] starts one." in out
        with pytest.raises(ClusterError, match="could not start 2 local engines"):
            prestarting.distrain("", "x = 1\n")
    monkeypatch.setattr(cluster_module, "_ipp_cluster", real)
    monkeypatch.setattr(cluster_module, "ENGINE_START_TIMEOUT_S", 120)
    with no_process_left():
        prestarting.distrain("-o res", "world_size\n")  # the error was shown: this one starts
        assert prestarting.shell.user_ns["res"].values == [2, 2]
        prestarting.close()


def test_interrupt_while_the_first_cell_waits_for_the_start(prestarting, monkeypatch):
    """The SIGINT arrives while the background thread launches the engines, a second or more
    after the first cell began to wait for it. The cell returns only once that start has
    stopped what it started: it used to return at once when the interrupt cut into
    ``Thread.join`` (which then takes a running thread for stopped), and the start's
    cancellation reached the next cell as a KeyboardInterrupt."""
    real = cluster_module._ipp_cluster
    start_stopped = threading.Event()

    def hooked(*args, **kwargs):
        ipp_cluster = real(*args, **kwargs)
        start_engines = ipp_cluster.start_engines_sync

        def interrupt_the_waiting_cell(*a, **k):
            os.kill(os.getpid(), signal.SIGINT)  # to the main thread, which waits
            time.sleep(0.5)  # the interrupt lands while this start still runs
            return start_engines(*a, **k)

        ipp_cluster.start_engines_sync = interrupt_the_waiting_cell
        return ipp_cluster

    cluster = prestarting.cluster
    real_stop = cluster._stop

    def stop_seen(*args):
        real_stop(*args)
        if threading.current_thread() is not threading.main_thread():
            start_stopped.set()  # the cancelled start stopped its own processes

    monkeypatch.setattr(cluster_module, "_ipp_cluster", hooked)
    monkeypatch.setattr(cluster, "_stop", stop_seen)
    with no_process_left():
        prestarting.start_in_background()
        with pytest.raises(KeyboardInterrupt):
            prestarting.distrain("", "x = 1\n")
        assert start_stopped.is_set()
        assert prestarting.session.background_error is None
        assert not cluster.running
    monkeypatch.undo()
    monkeypatch.setenv(PRESTART_ENV, "1")
    with no_process_left():
        prestarting.distrain("-o res", "world_size\n")  # the next cell starts workers
        assert prestarting.shell.user_ns["res"].values == [2, 2]
        prestarting.close()


def test_interrupt_just_after_the_background_start_ended(prestarting, monkeypatch):
    """The SIGINT lands after the background start's last step (its engines launched, nothing
    left for it to cancel): the notebook's thread stops those engines, and the next cell starts
    afresh (a cancel flag shared by both starts used to stop it at its first step)."""
    cluster = prestarting.cluster
    real = cluster.launch

    def launch_then_interrupt(*args, **kwargs):
        real(*args, **kwargs)
        if threading.current_thread() is not threading.main_thread():
            os.kill(os.getpid(), signal.SIGINT)  # to the main thread, which waits for this one
            # The start ends only once the interrupt was taken (the waiting cell cancels it).
            assert kwargs["cancel"].wait(10)

    monkeypatch.setattr(cluster, "launch", launch_then_interrupt)
    with no_process_left():
        prestarting.start_in_background()
        with pytest.raises(KeyboardInterrupt):
            prestarting.distrain("", "x = 1\n")
        assert prestarting.session.background_error is None
        assert not cluster.running
    monkeypatch.undo()
    monkeypatch.setenv(PRESTART_ENV, "1")
    with no_process_left():
        prestarting.distrain("-o res", "world_size\n")  # the next cell starts workers
        assert prestarting.shell.user_ns["res"].values == [2, 2]
        prestarting.close()


def test_kernel_shut_down_one_second_after_load_ext_leaves_no_process(tmp_path):
    """A real Jupyter kernel (prestart on by default there), shut down the normal way while its
    workers are still starting; every process it ever had is gone afterwards."""
    from jupyter_client.manager import KernelManager

    env = {k: v for k, v in os.environ.items() if k != PRESTART_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable
    km.start_kernel(env=env, cwd=str(tmp_path))
    kernel = psutil.Process(km.provisioner.pid)
    seen: dict[int, psutil.Process] = {}
    commands: dict[int, str] = {}  # read when first seen: a process that is gone has none
    done = threading.Event()

    def watch():  # every descendant the kernel ever has, until it is gone
        while not done.is_set():
            try:
                for child in kernel.children(recursive=True):
                    if child.pid not in seen:
                        seen[child.pid] = child
                        commands[child.pid] = " ".join(_cmdline(child))
            except psutil.NoSuchProcess:
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        reply = client.execute_interactive("%load_ext nbdist", timeout=60)
        assert reply["content"]["status"] == "ok"
        time.sleep(1)
        client.stop_channels()
        km.shutdown_kernel(now=False)
    finally:
        done.set()
        watcher.join()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    assert any("nbdist" in c for c in commands.values()), (
        f"the kernel started no nbdist process within 1 s: nothing was tested ({commands})"
    )
    _, alive = psutil.wait_procs(list(seen.values()), timeout=15)
    assert not alive, f"left behind: {[(p.pid, commands[p.pid]) for p in alive]}"


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []
