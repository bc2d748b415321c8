"""%distrain connect: engines started elsewhere, grouped by the address other hosts reach them at.

A controller and two engines start as separate processes, as ``ipcluster`` would start them on
other hosts; the engines present different addresses (127.0.0.2 and 127.0.0.3, both loopback),
so this one machine looks like two hosts to nbdist, torch.distributed and TensorFlow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from IPython.core.error import UsageError

from nbdist import ClusterError
from nbdist.kernel.connected import ConnectedCluster
from tests.cells import cell_in
from tests.procs import no_process_left

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

CLUSTER_ID = "nbdist-test"


def _wait_for(path, timeout=30):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    """A controller and engines nbdist did not start; stopped at the end of the module."""
    profile = tmp_path_factory.mktemp("profile_elsewhere")
    common = [f"--profile-dir={profile}", f"--cluster-id={CLUSTER_ID}", "--log-level=ERROR"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ipyparallel.controller", "--ip=127.0.0.1", *common],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]
    _wait_for(profile / "security" / f"ipcontroller-{CLUSTER_ID}-engine.json")
    for address in ("127.0.0.3", "127.0.0.2"):  # registration order is not rank order
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ipyparallel.engine", *common],
                env=os.environ | {"NBDIST_ADDRESS": address},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    yield profile, procs
    # Each in a process group of its own (start_new_session): an engine's nanny, orphaned when
    # a test killed its engine, is still in the group and goes with it.
    for p in procs:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(_group_alive(p.pid) for p in procs):
        time.sleep(0.05)
    for p in procs:
        _signal_group(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.wait(5)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def connected(shell, elsewhere):
    profile, _ = elsewhere
    shell.run_line_magic(
        "distrain", f"connect --profile-dir {profile} --cluster-id {CLUSTER_ID} --timeout 60 -n 2"
    )
    yield shell
    shell.run_line_magic("distrain", "stop")


def test_engines_grouped_by_reachable_address(connected, magics, capsys):
    assert magics.cluster.connected_text() == (
        "nbdist: connected to 2 engines on 2 hosts (127.0.0.2: 1 engine, 127.0.0.3: 1 engine); "
        "%distrain status shows them"
    )
    engines = magics.cluster.engines
    assert [(e.rank, e.address, e.local_rank, e.local_world_size) for e in engines] == [
        (0, "127.0.0.2", 0, 1),
        (1, "127.0.0.3", 0, 1),
    ]
    connected.run_line_magic("distrain", "status")
    out = capsys.readouterr().out
    folder = magics.cluster.connected_with["profile_dir"]
    assert "nbdist: 2 workers on 2 hosts, a connected ipyparallel cluster (profile folder " \
        f"{folder}, cluster id {CLUSTER_ID})" in out  # fmt: skip
    assert "(127.0.0.2): 1 engine, ranks 0-0, GPUs none" in out
    assert "(127.0.0.3): 1 engine, ranks 1-1, GPUs none" in out


DDP_CELL = """
import os
import psutil
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
for step in range(10):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
port = int(os.environ["MASTER_PORT"])
listening = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp")
                    if c.status == "LISTEN" and c.laddr.port == port})
env = {k: os.environ[k] for k in ("MASTER_ADDR", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
(env, listening, [p.detach().tolist() for p in model.parameters()])
"""


def test_ddp_rendezvous_on_rank_0s_address_and_trains(connected):
    connected.run_cell_magic("distrain", "-o res --framework torch", DDP_CELL)
    (env0, listen0, params0), (env1, listen1, params1) = connected.user_ns["res"].values
    assert env0 == {"MASTER_ADDR": "127.0.0.2", "RANK": "0", "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
    assert env1 == {"MASTER_ADDR": "127.0.0.2", "RANK": "1", "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
    assert (listen0, listen1) == (["127.0.0.2"], [])  # the store: on rank 0's host address only
    assert params0 == params1


TF_CELL = """
import json, os
import numpy as np, keras
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
x = np.random.default_rng(0).normal(size=(128, 4)).astype("float32")
model.fit(x, x.sum(1), batch_size=32, epochs=2, verbose=0)
(json.loads(os.environ["TF_CONFIG"]), [w.tolist() for w in model.get_weights()])
"""


@pytest.mark.tf
def test_tf_on_a_connected_cluster_needs_expose_tf(connected, capsys):
    """Its engines share their hosts' networks: TF's servers would be reachable there."""
    with pytest.raises(UsageError, match="add --expose-tf to run anyway"):
        connected.run_cell_magic("distrain", "--framework tf", TF_CELL)
    assert "gRPC" not in capsys.readouterr().out


@pytest.mark.tf
def test_tf_config_lists_each_engines_address_and_trains(connected, capsys):
    connected.run_cell_magic("distrain", "-o res --expose-tf --framework tf", TF_CELL)
    out = capsys.readouterr().out
    assert out.count("nbdist: --expose-tf: each TensorFlow worker's gRPC server listens") == 1
    assert "(127.0.0.2, 127.0.0.3)" in out
    (config0, w0), (config1, w1) = connected.user_ns["res"].values
    workers = config0["cluster"]["worker"]
    assert [w.rsplit(":", 1)[0] for w in workers] == ["127.0.0.2", "127.0.0.3"]
    assert config1["cluster"]["worker"] == workers
    assert (config0["task"]["index"], config1["task"]["index"]) == (0, 1)
    assert w0 == w1


@pytest.mark.tf
def test_a_restart_the_connected_engines_need_refuses_further_cells(connected, elsewhere):
    """TensorFlow cannot switch from multi-worker to mirrored collectives in one process: the
    engines need a restart, which is not nbdist's to do here. The cell says so, and so does the
    next one until the cluster is connected again."""
    profile, _ = elsewhere
    connected.run_cell_magic("distrain", "--expose-tf --framework tf", "x = 1")
    refusal = (
        "the workers need a restart (TensorFlow in these workers already ran multiworker "
        "collectives and cannot switch to mirrored in the same process), and nbdist does not "
        f"start or stop the engines of a connected ipyparallel cluster (profile folder {profile}, "
        f"cluster id {CLUSTER_ID}). Restart them with ipcluster stop --profile-dir {profile} "
        f"--cluster-id {CLUSTER_ID}; ipcluster start --profile-dir {profile} --cluster-id "
        f"{CLUSTER_ID}, then %distrain connect --profile-dir {profile} --cluster-id {CLUSTER_ID}."
    )
    with pytest.raises(ClusterError) as e:
        connected.run_cell_magic("distrain", "--framework tf --strategy mirrored", "x = 1")
    assert str(e.value) == refusal
    with pytest.raises(ClusterError) as e:
        connected.run_cell_magic("distrain", "--framework torch", "x = 1")
    assert str(e.value) == refusal
    connected.run_line_magic(
        "distrain", f"connect --profile-dir {profile} --cluster-id {CLUSTER_ID} --timeout 60 -n 2"
    )
    connected.run_cell_magic("distrain", "-o res --framework torch", "rank")
    assert connected.user_ns["res"].values == [0, 1]


def test_connected_cluster_is_not_resized_or_restarted(connected):
    with pytest.raises(UsageError, match="-n 3, but the connected cluster has 2 engines"):
        connected.run_cell_magic("distrain", "-n 3 --framework torch", "x = 1")
    with pytest.raises(ClusterError, match="nbdist does not start or stop the engines of a "
                       "connected ipyparallel cluster"):  # fmt: skip
        connected.run_line_magic("distrain", "restart")
    connected.run_cell_magic("distrain", "-n 1 -o res --framework torch", "world_size")
    assert connected.user_ns["res"].values == [1]  # a subset of the engines is fine


def test_stop_disconnects_and_leaves_the_engines_running(shell, elsewhere, capsys):
    profile, procs = elsewhere
    shell.run_line_magic("distrain", f"connect --profile-dir {profile} --cluster-id {CLUSTER_ID}")
    shell.run_cell_magic("distrain", "--framework torch", "kept = rank\n")
    capsys.readouterr()
    shell.run_line_magic("distrain", "stop")
    # One true sentence: nothing was stopped, nothing is gone.
    assert capsys.readouterr().out == (
        "nbdist: disconnected; the connected cluster's engines keep running, with what the cells "
        "left on them (this notebook no longer uses them)\n"
    )
    assert all(p.poll() is None for p in procs)


def test_connect_to_nothing_says_how_to_start_one(shell, tmp_path):
    with pytest.raises(ClusterError, match="ipcluster start -n N --profile NAME"):
        shell.run_line_magic("distrain", f"connect --profile-dir {tmp_path} --timeout 2")


def test_connection_file(shell, elsewhere):
    profile, _ = elsewhere
    path = profile / "security" / f"ipcontroller-{CLUSTER_ID}-client.json"
    assert json.loads(path.read_text())["interface"].startswith("tcp://127.0.0.1")
    shell.run_line_magic("distrain", f"connect --file {path}")
    try:
        shell.run_cell_magic("distrain", "-o res --framework torch", "rank")
        assert shell.user_ns["res"].values == [0, 1]
    finally:
        shell.run_line_magic("distrain", "stop")


def test_engines_that_do_not_answer_leave_no_connection_behind(elsewhere):
    """Both engines busy with another client's task: they registered, but cannot say who they
    are within the timeout."""
    import ipyparallel as ipp

    profile, _ = elsewhere
    other = ipp.Client(profile_dir=str(profile), cluster_id=CLUSTER_ID)
    cluster = ConnectedCluster()
    try:
        other.wait_for_engines(2, timeout=60, interactive=False)
        busy = other[:].apply_async(time.sleep, 60)
        with pytest.raises(ClusterError) as e:
            cluster.connect(profile_dir=str(profile), cluster_id=CLUSTER_ID, timeout=1, workers=2)
        assert str(e.value) == (
            f"connected to profile folder {profile}, cluster id {CLUSTER_ID}, but its engines "
            "did not answer within 1 s (TimeoutError: Result not ready.). Are they busy, or is "
            "nbdist missing from their Python environment (pip install nbdist there)?"
        )
        assert not cluster.running and cluster.engines == []
    finally:
        other.send_signal(signal.SIGINT, targets=other.ids, block=True)
        busy.wait(30)
        other.close()
    assert busy.ready()


def test_an_interrupt_while_connecting_leaves_no_connection_behind(elsewhere):
    """A real SIGINT once the client is open, just before nbdist asks the engines who they
    are: the interrupt reaches the user, and the cluster is not left half connected."""
    profile, _ = elsewhere
    cluster = ConnectedCluster()
    learn = cluster._learn_engines

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt is raised here
        return learn(*args, **kwargs)

    cluster._learn_engines = interrupted
    with pytest.raises(KeyboardInterrupt):
        cluster.connect(profile_dir=str(profile), cluster_id=CLUSTER_ID, timeout=30, workers=2)
    assert not cluster.running and cluster.engines == []
    del cluster._learn_engines
    cluster.connect(profile_dir=str(profile), cluster_id=CLUSTER_ID, timeout=30, workers=2)
    assert cluster.size == 2
    cluster.stop()


@pytest.fixture
def lone_controller(tmp_path):
    """A controller that no engine ever registers with."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ipyparallel.controller", "--ip=127.0.0.1",
         f"--profile-dir={tmp_path}", "--cluster-id=lone", "--log-level=ERROR"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_for(tmp_path / "security" / "ipcontroller-lone-client.json")
        yield tmp_path, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_controller_without_engines_says_how_to_start_them(lone_controller):
    """The controller forks its schedulers after it wrote its connection file, now and then
    while the block below already runs: those are the fixture's, not left behind by it."""
    folder, controller = lone_controller
    cluster = ConnectedCluster()
    with no_process_left(spare=controller), pytest.raises(ClusterError) as e:
        cluster.connect(profile_dir=str(folder), cluster_id="lone", timeout=1)
    assert str(e.value) == (
        f"connected to the controller (profile folder {folder}, cluster id lone), but only 0 "
        "engines registered within 1 s. Wait and %distrain connect again with a longer "
        "--timeout, start the missing engines, or use the ones there with -n 1. Restart them "
        f"with ipcluster stop --profile-dir {folder} --cluster-id lone; ipcluster start "
        f"--profile-dir {folder} --cluster-id lone, then %distrain connect --profile-dir "
        f"{folder} --cluster-id lone."
    )
    assert not cluster.running


def test_a_rank_that_ignores_the_interrupt_is_left_running_and_said_so(
    shell, elsewhere, magics, tmp_path
):
    """nbdist kills no engine it did not start: a rank that ignores the interrupt is left to
    run, and the error says which, where, and how to stop it."""
    from nbdist import JobTimeout

    profile, _ = elsewhere
    shell.run_line_magic("distrain", f"connect --profile-dir {profile} --cluster-id {CLUSTER_ID}")
    stubborn = magics.cluster.engines[1]
    go_on = tmp_path / "go-on"
    cell = (
        "import os, signal, time\n"
        "previous = signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "try:\n"
        f"    while rank == 1 and not os.path.exists({str(go_on)!r}):\n"
        "        time.sleep(0.1)\n"
        "finally:\n    signal.signal(signal.SIGINT, previous)\n"
    )
    start = time.monotonic()
    with pytest.raises(JobTimeout) as info:
        shell.run_cell_magic("distrain", "--framework torch --no-plot --timeout 2", cell)
    assert time.monotonic() - start < 15  # 2 s, the grace, the collective timeout
    assert (
        f"rank 1 (host {stubborn.host}, pid {stubborn.pid}) still runs the cell: nbdist does not "
        "kill engines it did not start, and its next cell waits for this one."
    ) in str(info.value)
    assert str(info.value).startswith("the job ran past --timeout 2 s. Raise --timeout")
    assert [e.pid for e in magics.cluster.engines][1] == stubborn.pid
    # The status names the cell the engine still runs, as the notebook names it.
    status = magics.session.status_text()
    assert f" busy: still runs {cell_in(shell)}" in status, status
    go_on.touch()  # it ends on its own; the next cell runs once it has
    shell.run_cell_magic("distrain", "-o res --no-plot", "world_size")
    assert shell.user_ns["res"].values == [2, 2]


def test_a_dead_engine_is_reported_and_not_restarted(shell, elsewhere, magics):
    """Last in this module: it kills one of the engines. nbdist kills or restarts none of the
    engines of a cluster it did not start: the one that answers goes on alone."""
    from nbdist import WorkerDied

    profile, procs = elsewhere
    shell.run_line_magic("distrain", f"connect --profile-dir {profile} --cluster-id {CLUSTER_ID}")
    try:
        shell.run_line_magic("distrain", "reset")  # what the module's earlier tests left there
        shell.run_cell_magic(
            "distrain", "--framework torch --no-plot",
            "model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nsteps = 0\n",
        )  # fmt: skip
        victim = next(e for e in magics.cluster.engines if e.address == "127.0.0.3")
        cell = (
            f"import os, time\nif rank == {victim.rank}:\n    os.kill(os.getpid(), 9)\n"
            "time.sleep(60)"
        )
        start = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            shell.run_cell_magic("distrain", "--framework torch", cell)
        message = str(info.value)
        assert message.startswith(
            f"rank {victim.rank} (host {victim.host}, pid {victim.pid}) stopped answering during "
            "the job: the controller lost its heartbeat (died, or vm unreachable)"
        )
        # Engines started by hand: no launcher to ask for a new one. The survivor heals alone.
        assert message.splitlines()[-1] == (
            f"The session was healed on fewer ranks: no engine could be started for rank "
            f"{victim.rank}, so the one that answers goes on as rank 0, and every rank got rank "
            f"{1 - victim.rank}'s variables (model, opt, steps) and imports (os, time); the next "
            "cell wraps model in DistributedDataParallel again, on a new process group. Values "
            "the cells computed from the rank (a gpu_id = LOCAL_RANK, a shard of your own) are "
            f"rank {1 - victim.rank}'s on every rank now: set them again."
        ), message
        assert time.monotonic() - start < 30
        # nbdist restarts nothing it did not start: the engine that answers goes on, ranked 0,
        # with its variables.
        survivor = next(e for e in magics.cluster.engines if e.pid != victim.pid)
        assert [e.pid for e in magics.cluster.engines] == [survivor.pid]
        shell.run_cell_magic(
            "distrain", "--framework torch --no-plot -o res",
            "for _ in range(3):\n    opt.zero_grad()\n    model(torch.ones(2, 4)).sum().backward()"
            "\n    opt.step()\n    steps += 1\n(rank, world_size, steps, type(model).__name__)",
        )  # fmt: skip
        assert shell.user_ns["res"].values == [(0, 1, 3, "DistributedDataParallel")]
    finally:
        shell.run_line_magic("distrain", "stop")
