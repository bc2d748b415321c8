"""An interrupt at any point of a start, a resize or an engine replacement leaves a working
cluster or none, never a half state, and no process behind; replaced engines are the new ones.

Each interrupt is a real SIGINT to this process, sent at a chosen step (right after an
ipyparallel call returns, or before nbdist asks the engines who they are), so the window is hit
on every run rather than by timing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from IPython.core.error import UsageError

from nbdist import ClusterError, JobInterrupted
from nbdist.engine import worker
from nbdist.kernel import commands, regroup
from nbdist.kernel import engines as engines_module
from nbdist.kernel import local as cluster_module
from nbdist.kernel.local import LocalCluster, engine_nannies
from tests.procs import no_process_left, once_written

pytestmark = [pytest.mark.cluster, pytest.mark.torch]


def _interrupt_after(obj, name: str) -> None:
    """``obj.name(...)`` sends SIGINT to this process once it has returned."""
    real = getattr(obj, name)

    def then_interrupt(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt is raised here
        raise AssertionError("the SIGINT did not arrive")

    setattr(obj, name, then_interrupt)


def _interrupt_before(obj, name: str) -> None:
    real = getattr(obj, name)

    def interrupt_first(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        return real(*args, **kwargs)

    setattr(obj, name, interrupt_first)


def _assert_works(cluster: LocalCluster, n: int) -> None:
    """``n`` engines that answer, each its own process."""
    infos = [cluster.apply_async(r, worker.engine_info).get(30) for r in range(cluster.size)]
    assert cluster.size == n
    assert sorted(i.pid for i in infos) == sorted(e.pid for e in cluster.engines)
    assert len({i.pid for i in infos}) == n


@pytest.mark.parametrize(
    "step", ["start_controller_sync", "start_engines_sync", "connect_client_sync"]
)
def test_interrupt_during_a_cold_start_leaves_no_cluster(monkeypatch, step):
    real = cluster_module._ipp_cluster

    def hooked(*args, **kwargs):
        ipp_cluster = real(*args, **kwargs)
        _interrupt_after(ipp_cluster, step)
        return ipp_cluster

    monkeypatch.setattr(cluster_module, "_ipp_cluster", hooked)
    cluster = LocalCluster(notify=lambda msg: None)
    with no_process_left():
        with pytest.raises(KeyboardInterrupt):
            cluster.start(2)
        assert not cluster.running and cluster.engines == []
    monkeypatch.setattr(cluster_module, "_ipp_cluster", real)
    with no_process_left():
        cluster.ensure(None)  # what the next cell does
        _assert_works(cluster, 2)
        cluster.stop()


def test_interrupt_while_waiting_for_engines_or_learning_them_leaves_no_cluster():
    cluster = LocalCluster(notify=lambda msg: None)
    _interrupt_before(cluster, "_learn_engines")
    with no_process_left():
        with pytest.raises(KeyboardInterrupt):
            cluster.start(2)
        assert not cluster.running and cluster.engines == []
    del cluster._learn_engines  # the class's own method again

    # While the client waits for the engines to register: a SIGINT as soon as it exists.
    def interrupt_once_connected():
        deadline = time.monotonic() + 60
        while cluster._client is None and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)

    with no_process_left():
        thread = threading.Thread(target=interrupt_once_connected)
        thread.start()
        with pytest.raises(KeyboardInterrupt):
            cluster.start(2)
            time.sleep(5)  # a start that beat the SIGINT: it lands here, and the test fails
        thread.join()
        assert not cluster.running and cluster.engines == []


@pytest.mark.parametrize("step", ["stop_engines_sync", "start_engines_sync", "_learn_engines"])
def test_interrupt_during_a_resize_leaves_no_cluster(step):
    cluster = LocalCluster(notify=lambda msg: None)
    with no_process_left():
        cluster.start(1)
        profile = cluster._reaper.record.profile
        if step == "_learn_engines":
            _interrupt_before(cluster, step)
        else:
            _interrupt_after(cluster._cluster, step)
        with pytest.raises(KeyboardInterrupt):
            cluster.ensure(2)  # a resize replaces every engine
        assert not cluster.running and cluster.engines == []
        assert engine_nannies(profile) == []  # orphans too: no_process_left cannot see them
    cluster.__dict__.pop("_learn_engines", None)
    with no_process_left():
        cluster.ensure(2)
        _assert_works(cluster, 2)
        cluster.stop()


def test_engines_that_do_not_register_in_time(monkeypatch):
    """A start or a replacement whose engines do not register in time is a ClusterError, and
    leaves no cluster and no process."""
    monkeypatch.setattr(cluster_module, "ENGINE_START_TIMEOUT_S", 0.01)
    cluster = LocalCluster(notify=lambda msg: None)
    with no_process_left():
        with pytest.raises(
            ClusterError, match="could not start 2 local engines: .*%distrain start"
        ):
            cluster.start(2)
        assert not cluster.running
    monkeypatch.setattr(cluster_module, "ENGINE_START_TIMEOUT_S", 120)
    with no_process_left():
        cluster.start(1)
        monkeypatch.setattr(cluster_module, "ENGINE_START_TIMEOUT_S", 0.01)
        with pytest.raises(
            ClusterError,
            match=r"the engines could not be replaced \(ClusterError: only 0 of 1 new engines "
            r"registered within 0.01 s\); the cluster was stopped, and the next %%distrain",
        ):
            cluster.replace_engines(1)
        assert not cluster.running and cluster.engines == []


def test_a_controller_that_cannot_start_leaves_no_cluster(monkeypatch, tmp_path):
    """The controller's Python cannot start (PYTHONHOME names no Python; this process started
    before it was set): the start fails at once, says what to check and what to type next, and
    leaves no process behind."""
    monkeypatch.setenv("PYTHONHOME", str(tmp_path))
    cluster = LocalCluster(notify=lambda msg: None)
    with no_process_left():
        with pytest.raises(ClusterError) as info:
            cluster.start(2)
        assert not cluster.running
    assert str(info.value) == (
        "could not start 2 local engines: the ipyparallel controller exited while starting. "
        "Check that ipyparallel is installed in this kernel's environment, then run "
        "%distrain start again."
    )


def test_cells_right_after_a_replacement_run_on_the_new_engines(fresh_session, magics):
    """A killed engine stays listed by the hub for up to 10 s (heartbeat): a replacement right
    after the kill must wait for new engines, not count the dead one among them."""
    cluster = magics.cluster
    old = {e.engine_id for e in cluster.engines}
    assert cluster.kill([1])
    cluster.replace_engines()
    assert not old & {e.engine_id for e in cluster.engines}
    pids = [e.pid for e in cluster.engines]
    for _ in range(3):
        fresh_session.run_cell_magic("distrain", "-o res", "import os\n(rank, os.getpid())\n")
        assert fresh_session.user_ns["res"].values == [(0, pids[0]), (1, pids[1])]


# Each rank writes FOLDER/deaf-RANK once it ignores SIGINT.
SLEEP_IGNORING_SIGINT = (
    "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "open(f'FOLDER/deaf-{rank}', 'w').close()\ntime.sleep(60)\n"
)


def test_second_interrupt_while_the_engines_are_replaced(fresh_session, magics, tmp_path):
    """Ranks that ignore SIGINT are killed and the engines replaced; a second interrupt during
    that replacement stops the cluster cleanly, and the next cell starts a new one."""
    old = [e.pid for e in magics.cluster.engines]
    controller = magics.cluster._cluster.controller.pid
    _interrupt_after(magics.cluster._cluster, "start_engines_sync")
    deaf = [tmp_path / f"deaf-{rank}" for rank in (0, 1)]
    timer = once_written(deaf, lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(JobInterrupted) as info:
        fresh_session.run_cell_magic(
            "distrain", "--no-plot", SLEEP_IGNORING_SIGINT.replace("FOLDER", str(tmp_path))
        )
    timer.join()
    assert str(info.value).splitlines() == [
        "interrupted (Stop button or Kernel > Interrupt); stopped ranks 0, 1.",
        "The workers were stopped, and their variables went with them: the next %%distrain "
        "starts new workers; re-run the cells that build them.",
    ]
    assert not magics.cluster.running
    procs = [psutil.Process(pid) for pid in [*old, controller] if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive
    fresh_session.run_cell_magic("distrain", "-n 2 -o res", "world_size\n")
    assert fresh_session.user_ns["res"].values == [2, 2]


def test_clean_up_that_cannot_finish_replaces_the_engines(
    fresh_session, magics, monkeypatch, capsys
):
    """A rank that cannot leave its group in time after an interrupt (a DDP model whose
    ``__del__`` blocks, which runs when the model is unwrapped for the new group) gets the
    engines replaced; the next cell runs on the new ones."""
    monkeypatch.setattr(regroup, "DROP_WAIT_S", 3.0)
    fresh_session.run_cell_magic(
        "distrain",
        "",
        "import time\n"
        "class SlowDDP(nn.parallel.DistributedDataParallel):\n"
        "    def __del__(self):\n"
        "        time.sleep(30)\n"
        "wrap = SlowDDP if rank == 1 else nn.parallel.DistributedDataParallel\n"
        "model = wrap(nn.Linear(2, 2))\n",
    )
    old = [e.pid for e in magics.cluster.engines]
    capsys.readouterr()
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(JobInterrupted, match=r"interrupted .*; stopped ranks 0, 1"):
        fresh_session.run_cell_magic("distrain", "--no-plot", "time.sleep(60)\n")
    timer.join()
    assert (
        "nbdist: replacing the engines (rank 1 could not leave its process group cleanly)"
        in capsys.readouterr().out
    )
    new = [e.pid for e in magics.cluster.engines]
    assert len(new) == 2 and not set(old) & set(new)
    _, alive = psutil.wait_procs([psutil.Process(p) for p in old if psutil.pid_exists(p)], 10)
    assert not alive
    fresh_session.run_cell_magic("distrain", "-o res", "import os\n(world_size, os.getpid())\n")
    assert fresh_session.user_ns["res"].values == [(2, new[0]), (2, new[1])]


# -- the line magics' errors, on real workers ---------------------------------------------------
def test_pull_errors_name_the_rank_and_the_fix(fresh_session):
    with pytest.raises(UsageError) as info:
        fresh_session.run_line_magic("distrain", "pull nothere --rank 2")
    assert str(info.value) == "%distrain pull: --rank 2 does not exist; ranks go from 0 to 1."
    with pytest.raises(
        UsageError,
        match=r"%distrain pull: rank 1: NameError: no variable 'nothere' on this worker",
    ):
        fresh_session.run_line_magic("distrain", "pull nothere --rank 1")
    fresh_session.run_cell_magic("distrain", "", "squares = (i * i for i in range(3))\n")
    with pytest.raises(
        UsageError,
        match=r"%distrain pull: rank 0: TypeError: squares is a generator, which cannot be sent "
        r"to the notebook",
    ):
        fresh_session.run_line_magic("distrain", "pull squares")


def test_a_command_on_a_busy_rank_says_so(fresh_session, magics, monkeypatch):
    monkeypatch.setattr(commands, "COMMAND_TIMEOUT_S", 0.5)
    busy = magics.cluster.apply_async(1, time.sleep, 3)
    with pytest.raises(
        UsageError,
        match=r"%distrain vars: rank 1 did not answer within 0.5 s \(is a cell still running "
        r"there\?\); %distrain status shows which rank is busy",
    ):
        fresh_session.run_line_magic("distrain", "vars")
    busy.get(30)


def test_set_up_work_on_a_busy_rank_names_it(fresh_session, magics, monkeypatch):
    """Set-up calls (imports, a rendezvous) wait SETUP_TIMEOUT_S for every rank, then name the
    one that did not answer: here rank 1, busy with a task of its own."""
    monkeypatch.setattr(engines_module, "SETUP_TIMEOUT_S", 5.0)
    cluster = magics.cluster
    busy = cluster.apply_async(1, time.sleep, 60)
    silent = cluster.engines[1]
    try:
        with pytest.raises(ClusterError) as info:
            cluster.apply_all(worker.engine_info, lambda e: {})
    finally:
        cluster.interrupt([1])
        busy.wait(30)
    assert str(info.value) == (
        f"rank 1 (host {silent.host}, pid {silent.pid}) did not answer within 5 s while setting "
        "up; is a cell still running there? %distrain status shows it; %distrain restart gives "
        "fresh workers."
    )
    assert busy.ready()


def test_compare_of_a_value_that_cannot_be_compared(fresh_session):
    fresh_session.run_cell_magic("distrain", "", "ghost = torch.empty(3, device='meta')\n")
    with pytest.raises(
        UsageError,
        match=r"%distrain compare: rank 0: TypeError: cannot compare a meta tensor: it has no "
        r"data",
    ):
        fresh_session.run_line_magic("distrain", "compare ghost")
