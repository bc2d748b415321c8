"""A session that survives a lost worker (torch, a local cluster): the survivors keep their
variables, a new engine takes the dead rank and gets a survivor's variables, and the next cell
trains on with the replicas equal. Real engines, a real gloo group, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from nbdist import WorkerDied
from tests.cgroups import memory_cgroup
from tests.procs import cell_started, kill_now, once_written

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

BUILD = """
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(),
                                                          nn.Linear(64, 1)))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(rank)
X = torch.randn(256, 16, generator=g)
Y = X.sum(1, keepdim=True)
done = 0
"""
TRAIN = """
import time
for step in range(STEPS):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(X), Y)
    loss.backward()
    opt.step()
    done += 1
    time.sleep(PAUSE)
(done, round(loss.item(), 6), type(model).__name__)
"""


def _train(sh, steps, pause=0.0, flags="--no-plot", first=""):
    sh.user_ns.update(STEPS=steps, PAUSE=pause)
    return sh.run_cell_magic("distrain", f"{flags} --push STEPS,PAUSE", first + TRAIN)


def train_and_kill(sh, tmp_path, victims, world):
    """A long training cell (1000 steps of 0.05 s) whose ``victims`` (pids) are killed once
    every rank of ``world`` runs it (a file each writes as it starts) and 0.5 s on: the
    ``WorkerDied`` the cell must raise, and when the kill was (test_connect_healing's too)."""
    first, running = cell_started(tmp_path, world)
    killed: list[float] = []

    def kill() -> None:
        time.sleep(0.5)
        killed.append(time.monotonic())
        for pid in victims:
            kill_now(pid)

    killer = once_written(running, kill)
    try:
        with pytest.raises(WorkerDied) as info:
            _train(sh, 1000, pause=0.05, first=first)
    finally:
        killer.join()
    return info.value, killed[0]


def _replicas_equal(sh):
    for name in ("model", "opt"):
        same = sh.run_line_magic("distrain", f"compare {name}")
        assert same.identical, (name, same)


@pytest.fixture
def healing(fresh_session, magics):
    """Two warm, empty torch workers; healing is on, as by default."""
    assert magics.session.heal_lost
    return fresh_session


def test_a_rank_killed_between_cells_is_healed(healing, magics, capsys):
    sh = healing
    sh.run_cell_magic("distrain", "--no-plot", BUILD + "gen = (i for i in range(3))\n")
    _train(sh, 5)
    survivor, victim = (e.pid for e in magics.cluster.engines)
    kill_now(victim)
    capsys.readouterr()
    sh.run_line_magic("distrain", "status")
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith(
            "The next %%distrain cell heals the session (new engines get a survivor's variables); "
            "%distrain restart starts over."
        )
    )
    done, loss, kind = _train(sh, 5)
    out = capsys.readouterr()
    said = out.out + out.err
    assert "rank 1 (host" in said and "killed by SIGKILL" in said, said
    # Said at once, before the seconds a new engine takes, then what was done.
    announced = said.index(
        "; healing the session: starting a new engine for rank 1 and sending it rank 0's "
        "variables...\n"
    )
    assert said.index(
        "nbdist: the session was healed: a new engine took rank 1, and every rank got rank 0's "
        "variables (PAUSE, STEPS, X, Y, done, g, loss, model, opt, step) and imports (time)"
    ) > announced, said
    assert "Warning" not in said, said
    assert (
        "wraps model in DistributedDataParallel again, on a new process group. Values the cells "
        "computed from the rank (a gpu_id = LOCAL_RANK, a shard of your own) are rank 0's on "
        "every rank now: set them again. Not sent, re-run the cells that make them: gen "
        "(generator: TypeError)." in said
    ), said
    pids = [e.pid for e in magics.cluster.engines]
    assert pids[0] == survivor and pids[1] != victim
    # Trained on from where it was: 5 steps before, 5 after, on every rank alike.
    assert (done, kind) == (10, "DistributedDataParallel")
    _replicas_equal(sh)


def test_a_rank_killed_mid_cell_is_healed_and_the_next_cell_trains_on(healing, magics, tmp_path):
    sh = healing
    sh.run_cell_magic("distrain", "--no-plot", BUILD)
    _train(sh, 3)
    victim = magics.cluster.engines[1].pid
    error, killed = train_and_kill(sh, tmp_path, [victim], 2)
    took = time.monotonic() - killed
    message = str(error)
    assert f"pid {victim}" in message and "rank 1" in message, message
    last = message.splitlines()[-1]
    assert last.startswith(
        "The session was healed: a new engine took rank 1, and every rank got rank 0's variables ("
    ), message
    assert took < 15, took  # from the kill, the healing included
    done, _, kind = _train(sh, 4, flags="")
    assert kind == "DistributedDataParallel"
    _replicas_equal(sh)
    _curve_goes_on(magics, cells=3)


def test_a_rank_killed_for_ignoring_the_interrupt_is_healed(healing, magics, tmp_path):
    """Rank 1 ignores SIGINT, so nbdist kills it; rank 0 stopped on the interrupt and keeps its
    variables (torch goes on after one), and rank 1 gets them."""
    from nbdist import JobInterrupted

    sh = healing
    sh.run_cell_magic("distrain", "--no-plot", BUILD)
    _train(sh, 3)
    deaf = tmp_path / "deaf"
    cell = (
        "import signal\nif rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"    open({str(deaf)!r}, 'w').close()\n"
    )
    victim = magics.cluster.engines[1].pid
    timer = once_written([deaf], lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(JobInterrupted) as info:  # no step boundary: interrupted at once
        sh.run_cell_magic("distrain", "--no-plot", cell + "time.sleep(60)\n")
    timer.join()
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "interrupted (Stop button or Kernel > Interrupt); stopped ranks 0, 1. "
        "Rank 1 did not stop on the interrupt and was killed."
    )
    assert lines[-1].startswith(
        "The session was healed: a new engine took rank 1, and every rank got rank 0's variables ("
    ), lines
    assert victim not in [e.pid for e in magics.cluster.engines]
    done, _, kind = _train(sh, 2)
    assert (done, kind) == (5, "DistributedDataParallel")
    _replicas_equal(sh)


def _curve_goes_on(magics, *, cells):
    """The session's loss curve: one segment per training cell, each starting at the step after
    the one before ended (a healed model is a new object of the same state)."""
    spans = [(seg.steps[0], seg.steps[-1]) for seg in magics.session.curve]
    assert len(spans) == cells, spans
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:], strict=False)), spans


def test_a_rank_the_out_of_memory_killer_took_is_named_so_and_healed(healing, magics):
    """A real OOM kill: rank 1's engine in a cgroup with a 200 MiB limit allocates 1 GiB."""
    sh = healing
    sh.run_cell_magic("distrain", "--no-plot", BUILD)
    _train(sh, 3)
    victim = magics.cluster.engines[1].pid
    with memory_cgroup(200) as group, pytest.raises(WorkerDied) as info:
        (group / "cgroup.procs").write_text(str(victim))
        sh.run_cell_magic(
            "distrain", "--no-plot", "if rank == 1:\n    big = torch.ones(2**28)\nrank\n"
        )
    message = str(info.value)
    host = magics.cluster.engines[0].host
    assert (
        f"rank 1 (host {host}, pid {victim}) died during the job: rank 1 killed by SIGKILL from "
        "the kernel's out-of-memory killer (memory limit 200 MiB) (" in message
    ), message
    # The kernel log where this user may read it, else the cgroup's count.
    assert (
        f"(kernel log: Memory cgroup out of memory: Killed process {victim} (" in message
        or "/nbdist-oom-test-" in message
        and "rose from 0 to 1)). " in message
    ), message
    assert "Use less memory on each rank (a smaller batch or model), or fewer ranks" in message
    assert message.splitlines()[-1].startswith("The session was healed: a new engine took rank 1")
    done, _, kind = _train(sh, 2)
    assert (done, kind) == (5, "DistributedDataParallel")
    _replicas_equal(sh)


FSDP2_BUILD = """
from torch.distributed.device_mesh import init_device_mesh
torch.manual_seed(0)
sharded = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
mesh = init_device_mesh("cpu", (world_size,))
fully_shard(sharded, mesh=mesh)
opt = torch.optim.Adam(sharded.parameters(), lr=1e-2)
"""


def test_a_sharded_model_cannot_be_healed_and_says_why(healing, magics, capsys):
    """FSDP2: each rank holds its own shards; the dead rank's are gone with it."""
    from tests.fsdp import fully_shard_import

    sh = healing
    sh.run_cell_magic("distrain", "--no-plot", fully_shard_import() + FSDP2_BUILD)
    victim = magics.cluster.engines[1]
    kill_now(victim.pid)
    capsys.readouterr()
    assert sh.run_cell_magic("distrain", "--no-plot", "rank\n") == [0, 1]
    out = capsys.readouterr().out
    assert (
        f"nbdist: rank 1 (host {victim.host}, pid {victim.pid}) died after its last cell: killed "
        "by SIGKILL (kill -9, or the kernel's out-of-memory killer); not healed: opt, sharded "
        "are sharded across the ranks (FSDP2, DTensor): the shards of rank 1 died with it, and "
        "no survivor holds them. Save a checkpoint (torch.distributed.checkpoint) to resume "
        "sharded training." in out
    ), out
    assert "the workers were replaced; their variables" in out


def test_two_ranks_of_four_killed_at_once_mid_cell(healing, magics, capsys, tmp_path):
    """The two survivors are blocked in a collective with the dead; the one that fails first
    is released to free the other by leaving the group, and keeps its variables."""
    sh = healing
    sh.run_line_magic("distrain", "start -n 4")
    sh.run_cell_magic("distrain", "--no-plot", BUILD)
    _train(sh, 3)
    pids = [e.pid for e in magics.cluster.engines]
    error, _ = train_and_kill(sh, tmp_path, [pids[1], pids[2]], 4)
    assert (
        str(error)
        .splitlines()[-1]
        .startswith(
            "The session was healed: new engines took ranks 1, 2, and every rank got rank 0's "
            "variables (PAUSE, STEPS, X, Y, done, g, loss, model, opt, step)"
        )
    ), (error, capsys.readouterr())
    now = [e.pid for e in magics.cluster.engines]
    assert now[0] == pids[0] and now[3] == pids[3] and not {now[1], now[2]} & set(pids)
    sh.user_ns.update(STEPS=3, PAUSE=0.0)
    sh.run_cell_magic("distrain", "--no-plot -o res --push STEPS,PAUSE", TRAIN)
    done = sh.user_ns["res"].values
    assert len(set(done)) == 1 and done[0][2] == "DistributedDataParallel", done
    _replicas_equal(sh)
    sh.run_line_magic("distrain", "start -n 2")


def _descendants() -> list[int]:
    return sorted(p.pid for p in psutil.Process().children(recursive=True))


def test_ten_cycles_of_kill_heal_train_leak_nothing(healing, magics):
    """A soak: the same number of processes after each cycle, and the survivor's memory flat."""
    sh = healing
    sh.run_cell_magic("distrain", "--no-plot", BUILD)
    _train(sh, 2)
    survivor = psutil.Process(magics.cluster.engines[0].pid)
    counts, rss = [], []
    for cycle in range(10):
        kill_now(magics.cluster.engines[1].pid)
        done, _, _ = _train(sh, 2)
        assert done == 2 * (cycle + 2)
        counts.append(len(_descendants()))
        rss.append(survivor.memory_info().rss / 2**20)
    _replicas_equal(sh)
    assert len(set(counts)) == 1, counts
    assert rss[-1] - rss[1] < 40, rss  # MB; cycle 0 warms the snapshot's buffers up


TF_BUILD = """
import numpy as np
import keras
with strategy.scope():
    net = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    net.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
ds = strategy.experimental_distribute_dataset(
    __import__("tensorflow").data.Dataset.from_tensor_slices((x, y)).batch(64)
)
epochs = 0
"""
TF_FIT = """
net.fit(x, y, batch_size=64, epochs=2, verbose=0)
epochs += 2
(epochs, [float(w.sum()) for w in net.get_weights()], int(net.optimizer.iterations.numpy()))
"""


@pytest.mark.tf
@pytest.mark.slow
def test_tensorflow_heals_as_far_as_it_can_keras_models_rebuilt_in_the_new_scope(
    fresh_session, magics, capsys, tmp_path
):
    """A MultiWorkerMirroredStrategy cannot change its cluster: every engine is replaced, and
    each gets rank 0's variables, its Keras model rebuilt in the new strategy's scope with its
    weights and optimizer state; the dataset of the old strategy is named, not sent."""
    sh = fresh_session

    def values(cell):
        sh.run_cell_magic("distrain", "--no-plot -o res", cell)
        return sh.user_ns["res"].values

    sh.run_cell_magic("distrain", "--framework tf --no-plot", TF_BUILD)
    before = values(TF_FIT)
    assert before[0] == before[1] and before[0][2] == 8, before  # 2 epochs of 4 batches
    weights = values("[w.tolist() for w in net.get_weights()]")
    old = [e.pid for e in magics.cluster.engines]
    kill_now(old[1])
    capsys.readouterr()
    after = values("[w.tolist() for w in net.get_weights()]")
    said = capsys.readouterr().out
    assert (
        "the session was healed as far as TensorFlow allows: a MultiWorkerMirroredStrategy "
        "cannot change its cluster in place, so new engines took all 2 ranks, and every rank got "
        "rank 0's variables (epochs, net, rng, x, y) and imports (keras, np); the next cell "
        "builds net in its new "
        "strategy's scope (architecture, weights and optimizer state, from a .keras save). Values "
        "the cells computed from the rank (a gpu_id = LOCAL_RANK, a shard of your own) are rank "
        "0's on every rank now: set them again. Not sent, re-run the cells that make them: ds "
        "(DistributedDataset: TensorFlow object of the old strategy)." in said
    ), said
    assert not set(old) & {e.pid for e in magics.cluster.engines}
    assert after == [weights[0], weights[0]]  # rank 0's weights, on both new engines
    trained = values(TF_FIT)
    assert trained[0] == trained[1], trained  # trained in sync in the new strategy
    assert trained[0][0] == 4 and trained[0][2] == 16, trained  # the optimizer's steps go on

    # In the middle of a fit: the survivor's collective fails at its timeout, then the same.
    # Rank 1 is killed once rank 0, the survivor, has counted a fit of this cell (a fixed delay
    # could end before a loaded machine's first fit in the new engines does).
    victim = magics.cluster.engines[1].pid
    fitted = tmp_path / "fitted"
    killer = once_written([fitted], lambda: kill_now(victim))
    with pytest.raises(WorkerDied) as info:
        values("import time\nfor _ in range(200):\n    net.fit(x, y, batch_size=64, verbose=0)\n"
               f"    epochs += 1\n    if rank == 0:\n        open({str(fitted)!r}, 'w').close()\n"
               "    time.sleep(0.05)\n")  # fmt: skip
    killer.join()
    assert f"pid {victim}" in str(info.value), info.value
    assert (
        str(info.value)
        .splitlines()[-1]
        .startswith("The session was healed as far as TensorFlow allows")
    ), info.value
    trained = values(TF_FIT)
    assert trained[0] == trained[1] and trained[0][0] > 6, trained
    _curve_goes_on(magics, cells=4)  # the fits before, after, during and after the kill
