"""%%distrain on real local ipyparallel engines with real torch.distributed (gloo, CPU)."""

from __future__ import annotations

import textwrap
import time

import pytest
from IPython.core.error import UsageError

from nbdist import JobTimeout, WorkerDied, WorkerError
from tests.cells import cell_in

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

TRAIN = textwrap.dedent(
    """
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 10, generator=g)
    Y = X @ torch.randn(10, 5, generator=g)
    data = TensorDataset(X, Y)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)).to(device)
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for epoch in range(FAIL_EPOCHS):
        sampler.set_epoch(epoch)
        for step, (xb, yb) in enumerate(loader):
            FAIL_HOOK
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    (losses[0], losses[-1], [p.detach().clone() for p in model.parameters()])
    """
)


def train_cell(epochs=4, hook="pass"):
    return TRAIN.replace("FAIL_EPOCHS", str(epochs)).replace("FAIL_HOOK", hook)


def _engines_idle(magics, within: float) -> float:
    """Seconds until every engine reports no running task (fails after ``within``)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if not any(magics.cluster.busy().values()):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"engines still busy after {within} s: {magics.cluster.busy()}")


def test_ddp_mlp_trains_and_parameters_match(ready):
    ready.run_cell_magic("distrain", "-n 2 -o res", train_cell())
    res = ready.user_ns["res"]
    assert res.world_size == 2
    (first0, last0, params0), (first1, last1, params1) = res.values
    assert last0 < 0.75 * first0 and last1 < 0.75 * first1
    assert len(params0) == len(params1) == 4
    for a, b in zip(params0, params1, strict=True):
        assert a.equal(b)


def test_rank_env_is_exact_and_restored(ready, magics):
    cell = (
        "import os\n"
        "{k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE',"
        " 'MASTER_ADDR')}, (rank, world_size, local_rank, local_world_size, is_main, str(device))"
    )
    ready.run_cell_magic("distrain", "-o res --framework torch", cell)
    envs = [v[0] for v in ready.user_ns["res"].values]
    assert envs == [
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
        },
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
        },
    ]
    assert [v[1] for v in ready.user_ns["res"].values] == [
        (0, 2, 0, 2, True, "cpu"),
        (1, 2, 1, 2, False, "cpu"),
    ]

    # Read the engines' environment directly, outside any run.
    leftover = (
        "sorted(k for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')"
        " if k in __import__('os').environ)"
    )
    assert [magics.cluster.apply_async(r, eval, leftover).get(10) for r in (0, 1)] == [[], []]


def test_group_sockets_stay_on_loopback(ready, magics):
    """Every rank of a local job has gloo's and NCCL's bootstrap interface set to loopback while
    it runs (and not after: the engine's environment is restored), and runs in the cluster's
    private network namespace (only ``lo``)."""
    read = (
        "({k: __import__('os').environ.get(k) for k in ('GLOO_SOCKET_IFNAME', "
        "'NCCL_SOCKET_IFNAME')}, [l.split(':')[0].strip() for l in "
        "open('/proc/self/net/dev').readlines()[2:]])"
    )
    ready.run_cell_magic("distrain", "--framework torch -o res", read + "\n")
    # slirp4netns, where installed, adds the outbound-only link (tap0): nothing listens there.
    links = ["lo", "tap0"] if magics.cluster.network.outbound is not None else ["lo"]
    assert ready.user_ns["res"].values == [
        ({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}, links),
        ({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}, links),
    ]
    assert [magics.cluster.apply_async(r, eval, read).get(10) for r in (0, 1)] == [
        ({"GLOO_SOCKET_IFNAME": None, "NCCL_SOCKET_IFNAME": None}, links),
        ({"GLOO_SOCKET_IFNAME": None, "NCCL_SOCKET_IFNAME": None}, links),
    ]


def test_five_consecutive_runs_warm(ready):
    for _ in range(5):
        start = time.monotonic()
        ready.run_cell_magic("distrain", "-o res", train_cell(epochs=1))
        assert time.monotonic() - start < 5
        first, last, _ = ready.user_ns["res"].values[0]
        assert last < first


def test_output_streams_with_rank_prefix(ready, capsys):
    ready.run_cell_magic("distrain", "--framework torch", "print(f'hello from {rank}')\n")
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0\n" in out and "[rank 1] hello from 1\n" in out
    ready.run_cell_magic("distrain", "--ranks 1 --framework torch", "print(f'hello from {rank}')\n")
    out = capsys.readouterr().out
    assert "[rank 1] hello from 1\n" in out and "[rank 0]" not in out


def test_push_and_pull(ready):
    import torch

    ready.user_ns["base"] = torch.arange(4.0)
    ready.run_cell_magic(
        "distrain",
        "--push base --pull total,doubled --framework torch",
        "total = base.sum().item() + rank\ndoubled = base * 2\n",
    )
    assert ready.user_ns["total"] == 6.0
    assert ready.user_ns["doubled"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_pull_of_missing_name_names_it(ready):
    with pytest.raises(UsageError) as info:
        ready.run_cell_magic("distrain", "--pull nothere", "x = torch.ones(1)\n")
    assert "--pull: no variable 'nothere' on this worker (rank 0)" in str(info.value)


def test_seed_snippet_with_its_own_init_process_group(ready):
    """The article's PyTorch snippet: indentation fixed, nn.DataParallel removed, gloo, a loader."""
    seed = textwrap.dedent(
        """
        import torch
        import torch.nn as nn
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        dist.init_process_group(backend='gloo')
        data = TensorDataset(torch.randn(256, 10), torch.randn(256, 5))
        train_loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))
        model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
        model = DDP(model)
        loss_fn = nn.MSELoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            optimizer.step()
        dist.destroy_process_group()
        dist.get_world_size(), sum(p.sum().item() for p in model.parameters())
        """
    )
    ready.run_cell_magic("distrain", "-o res", seed)
    (w0, s0), (w1, s1) = ready.user_ns["res"].values
    assert (w0, w1) == (2, 2)
    assert s0 == s1
    # nbdist kept its group: the next run reuses it.
    ready.run_cell_magic("distrain", "-o res", "dist.get_world_size()\n")
    assert ready.user_ns["res"].values == [2, 2]


def test_rank_1_raises_at_step_50(ready, magics):
    hook = "if rank == 1 and epoch * len(loader) + step == 50: raise ValueError('bad batch')"
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        ready.run_cell_magic("distrain", "", train_cell(epochs=100, hook=hook))
    elapsed = time.monotonic() - start
    err = info.value
    assert err.ranks == [1]
    assert str(err).startswith("rank 1 (host ")
    assert "raised ValueError: bad batch" in str(err)
    assert f"at {cell_in(ready)}, line 19: if rank == 1 and epoch" in str(err)
    rendered = err._render_traceback_()
    assert sum(line.startswith("--- remote traceback") for line in rendered) == 1
    assert "rank 0 stopped because a peer failed." in rendered
    assert elapsed < 10
    _engines_idle(magics, within=10 - elapsed)
    ready.run_cell_magic("distrain", "-o res", train_cell(epochs=1))
    assert ready.user_ns["res"].values[0][1] < ready.user_ns["res"].values[0][0]


def test_even_ranks_of_four_raise(ready, magics):
    hook = "if rank % 2 == 0 and epoch * len(loader) + step == 5: raise ValueError('even')"
    try:
        ready.run_cell_magic("distrain", "-n 4 --framework torch", "x = 1\n")  # the resize
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            ready.run_cell_magic("distrain", "-n 4", train_cell(epochs=100, hook=hook))
        elapsed = time.monotonic() - start
        assert info.value.ranks == [0, 2]
        assert str(info.value).startswith("ranks 0, 2 (host ")
        _engines_idle(magics, within=10)
        ready.run_cell_magic("distrain", "-o res", train_cell(epochs=1))
        assert len(ready.user_ns["res"].values) == 4
    finally:
        ready.run_cell_magic("distrain", "-n 2 --framework torch", "x = 1\n")
    assert elapsed < 10


def test_all_ranks_fail_alike_shown_once(ready):
    with pytest.raises(WorkerError) as info:
        ready.run_cell_magic("distrain", "", "x = torch.ones(1)\nraise KeyError('missing')\n")
    assert info.value.ranks == [0, 1]
    rendered = info.value._render_traceback_()
    assert "--- remote traceback, ranks 0, 1 ---" in rendered
    assert sum(line.startswith("--- remote traceback") for line in rendered) == 1


def test_nccl_without_gpus(ready):
    with pytest.raises(UsageError, match="--backend nccl needs GPUs and this cluster has none"):
        ready.run_cell_magic("distrain", "--backend nccl", "x = torch.ones(1)\n")
    with pytest.raises(WorkerError) as info:
        ready.run_cell_magic("distrain", "", "dist.init_process_group('nccl')\n")
    assert "init_process_group('nccl') needs a GPU" in str(info.value)
    assert "Use backend='gloo' or drop the argument" in str(info.value)


def test_timeout_stops_a_hung_rank(ready, magics):
    start = time.monotonic()
    cell = "import time\nif rank == 0:\n    time.sleep(3600)\ndist.barrier()\n"
    with pytest.raises(JobTimeout, match="ran past --timeout 2 s"):
        ready.run_cell_magic("distrain", "--timeout 2", cell)
    assert time.monotonic() - start < 2 + 10
    _engines_idle(magics, within=5)
    ready.run_cell_magic("distrain", "-o res", "dist.get_world_size()\n")
    assert ready.user_ns["res"].values == [2, 2]


def test_worker_that_dies_is_reported_and_replaced(ready, magics):
    """With ``%distrain heal off`` (healing: tests/integration/test_healing.py)."""
    old = [e.pid for e in magics.cluster.engines]
    start = time.monotonic()
    ready.run_cell_magic("distrain", "", "kept_until_now = rank\n")
    cell = "import os, time\nif rank == 1:\n    os._exit(3)\ndist.barrier()\n"
    ready.run_line_magic("distrain", "heal off")
    try:
        with pytest.raises(
            WorkerDied,
            match=r"rank 1 \(host .*, pid \d+\) died during the job: rank 1 exited with status 3 "
            r"\(os._exit\(\), or a native library.s exit\(\)\)",
        ) as info:
            ready.run_cell_magic("distrain", "", cell)
    finally:
        ready.run_line_magic("distrain", "heal on")
    assert "The engines were replaced, and the workers' variables (" in str(info.value)
    assert "kept_until_now" in str(info.value).splitlines()[-1]
    assert time.monotonic() - start < 30
    assert not set(old) & {e.pid for e in magics.cluster.engines}
    ready.run_cell_magic("distrain", "-o res", "dist.get_world_size()\n")
    assert ready.user_ns["res"].values == [2, 2]


def test_resize_with_notice(ready, magics, capsys):
    ready.run_line_magic("distrain", "reset")
    ready.run_cell_magic("distrain", "", "before_resize = 1\n")
    ready.run_cell_magic("distrain", "-n 1 -o res --framework torch", "world_size\n")
    assert ready.user_ns["res"].values == [1]
    out = capsys.readouterr().out
    assert "resizing the cluster from 2 to 1 workers" in out
    assert (
        "nbdist: the workers were restarted or resized; their variables (before_resize) are "
        "gone: re-run the cells that build them." in out
    )
    ready.run_cell_magic("distrain", "-n 2 -o res --framework torch", "world_size\n")
    assert ready.user_ns["res"].values == [2, 2]


def test_scan_runs_the_cell_with_each_worker_count(ready, capsys):
    cell = "for step in range(4):\n    log(loss=1.0, samples=100)\nworld_size\n"
    ready.run_cell_magic("distrain", "--scan 1,2 --framework torch -o scan", cell)
    scan = ready.user_ns["scan"]
    assert scan.workers == (1, 2)
    assert [run.values for run in scan.runs] == [[1], [2, 2]]
    assert scan.unit == "samples/s"
    assert scan.throughput == (400 / scan.runs[0].wall, 800 / scan.runs[1].wall)
    assert scan.efficiency[1] == scan.throughput[1] / scan.throughput[0] / 2
    out = capsys.readouterr().out
    assert "nbdist: scan: 1 worker\n" in out and "nbdist: scan: 2 workers\n" in out
    assert "workers     samples/s  speedup  efficiency" in out
    assert out.count("<nbdist figure") == 0 and "<nbdist scan: throughput vs workers>" in out
    assert ready.run_cell_magic("distrain", "-o res --framework torch", "world_size") == 2
    assert ready.user_ns["res"].values == [2, 2]  # the scan left 2 workers, as it ended


@pytest.mark.slow
def test_stress_30_runs_mixed_success_and_failure(ready):
    """The group lifecycle must never hang: 30 runs, every third one failing mid-training."""
    for i in range(30):
        if i % 3 == 2:
            hook = "if rank == i % 2 and step == 3: raise RuntimeError('injected')".replace(
                "i % 2", str(i % 2)
            )
            with pytest.raises(WorkerError, match="injected"):
                ready.run_cell_magic("distrain", "--timeout 60", train_cell(epochs=1, hook=hook))
        else:
            ready.run_cell_magic("distrain", "--timeout 60 -o res", train_cell(epochs=1))
            (_, _, p0), (_, _, p1) = ready.user_ns["res"].values
            assert all(a.equal(b) for a, b in zip(p0, p1, strict=True))


def test_notebook_interrupt_stops_every_rank(ready, magics):
    """The kernel's interrupt arrives as KeyboardInterrupt in the magic while it waits."""
    import os
    import signal
    import threading

    from nbdist import JobInterrupted

    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(
        JobInterrupted,
        match=r"interrupted \(Stop button or Kernel > Interrupt\); stopped ranks 0, 1",
    ):
        ready.run_cell_magic("distrain", "--framework torch", "import time\ntime.sleep(3600)\n")
    assert time.monotonic() - start < 1.0 + 5
    _engines_idle(magics, within=5)
    ready.run_cell_magic("distrain", "-o res", "dist.get_world_size()\n")
    assert ready.user_ns["res"].values == [2, 2]


def test_an_interrupt_a_finalizer_took_still_stops_every_rank(ready, magics, capsys):
    """Python drops a KeyboardInterrupt raised in a ``__del__`` ("Exception ignored in"): the
    rank would compute on and be killed. The engines deliver it again; nothing is killed."""
    import os
    import signal
    import threading

    from nbdist import JobInterrupted

    cell = (
        "import time\n"
        "class Slow:\n"
        "    def __del__(self):\n"
        "        time.sleep(3)  # the interrupt, 1.5 s in, lands here\n"
        "Slow()\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    pids = [e.pid for e in magics.cluster.engines]
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(JobInterrupted) as info:
        ready.run_cell_magic("distrain", "--no-plot", cell)
    timer.join()
    assert str(info.value).splitlines()[0] == (
        "interrupted (Stop button or Kernel > Interrupt); stopped ranks 0, 1."
    )
    # Stopped, not killed (a kill comes seconds after the interrupt, and replaces the engines).
    assert [e.pid for e in magics.cluster.engines] == pids
    assert "Exception ignored" not in capsys.readouterr().err
    ready.run_cell_magic("distrain", "-o res", "dist.get_world_size()\n")
    assert ready.user_ns["res"].values == [2, 2]


def test_every_logged_point_arrives_in_order(ready):
    cell = "for i in range(3000):\n    log(value=i * (rank + 1))\nnbdist_done = True\n"
    ready.run_cell_magic("distrain", "-o res --framework torch", cell)
    history = ready.user_ns["res"].history
    for rank in (0, 1):
        points = [p for p in history if p["rank"] == rank]
        assert [p["step"] for p in points] == list(range(3000))
        assert [p["value"] for p in points] == [i * (rank + 1) for i in range(3000)]


def test_autolog_captures_loss_and_batch_size(ready):
    ready.run_cell_magic("distrain", "-o res", train_cell(epochs=2))
    res = ready.user_ns["res"]
    losses = res.values[0][0], res.values[0][1]
    for rank in (0, 1):
        points = [p for p in res.history if p["rank"] == rank]
        assert len(points) == 2 * 8  # 256 samples per rank, batches of 32, two epochs
        assert {p["samples"] for p in points} == {32}
        assert [p["step"] for p in points] == list(range(16))
    rank0 = [p["loss"] for p in res.history if p["rank"] == 0]
    assert (rank0[0], rank0[-1]) == pytest.approx(losses)
    ready.run_cell_magic("distrain", "-o res --no-autolog", train_cell(epochs=1))
    assert ready.user_ns["res"].history == ()


def test_interrupt_during_training_shows_figure_and_summary(ready, magics, capsys):
    """The Stop button interrupts the kernel; in the kernel that is this KeyboardInterrupt."""
    import os
    import signal
    import threading

    from nbdist import JobInterrupted

    interrupted = []
    before = magics.session.view  # the previous run's view: not this run's

    def interrupt_when_training():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            view = magics.session.view
            if view is not None and view is not before and view.agg.seen > 20:
                interrupted.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # never leave a 100,000-epoch run going

    thread = threading.Thread(target=interrupt_when_training)
    thread.start()
    with pytest.raises(JobInterrupted, match="every rank stopped after step"):
        ready.run_cell_magic("distrain", "", train_cell(epochs=100000))
    thread.join()
    assert interrupted, "the live view showed no training within 30 s"
    assert time.monotonic() - interrupted[0] < 5  # every rank stopped within 5 s
    out = capsys.readouterr().out
    assert "nbdist: final loss" in out and "<nbdist figure: loss and throughput>" in out
    _engines_idle(magics, within=5)
    ready.run_cell_magic("distrain", "-o res", train_cell(epochs=1))
    assert ready.user_ns["res"].values[0][1] < ready.user_ns["res"].values[0][0]


def test_stalled_rank_is_named_with_its_step(ready, magics):
    from nbdist import JobStalled

    hook = "if rank == 1 and epoch * len(loader) + step == 10: __import__('time').sleep(3600)"
    start = time.monotonic()
    with pytest.raises(JobStalled) as info:
        ready.run_cell_magic("distrain", "--stall 3", train_cell(epochs=100, hook=hook))
    assert time.monotonic() - start < 3 + 15
    message = str(info.value)
    assert message.startswith(
        f"no progress for 3 s: rank 1 is stuck at step 9 ({cell_in(ready)}, line 19: if rank == 1 "
        "and epoch * len(loader) + step == 10: __import__('time').sleep(3600)) (no progress for"
    )
    assert (
        "; rank 0 waits at step 10 in DDP's gradient all-reduce in backward() "
        f"({cell_in(ready)}, line 22: loss.backward()). Stopped ranks 0, 1." in message
    )
    assert "Stopped ranks 0, 1" in message
    _engines_idle(magics, within=5)
    ready.run_cell_magic("distrain", "-o res", train_cell(epochs=1))
    assert ready.user_ns["res"].values[0][1] < ready.user_ns["res"].values[0][0]


def test_ranks_waiting_on_each_other_before_any_step_are_stopped(ready, magics):
    from nbdist import JobStalled

    cell = "import time\nif rank == 1:\n    time.sleep(3600)\ndist.barrier()\n"
    start = time.monotonic()
    with pytest.raises(JobStalled) as info:
        ready.run_cell_magic("distrain", "--stall 3 --framework torch", cell)
    assert time.monotonic() - start < 3 + 15
    assert str(info.value).startswith(
        "no progress for 3 s and every rank sits idle (ranks 0, 1, no CPU use, none past its "
        "first step): they are waiting on each other"
    )
    _engines_idle(magics, within=5)
    ready.run_cell_magic("distrain", "-o res", train_cell(epochs=1))
    assert ready.user_ns["res"].values[0][1] < ready.user_ns["res"].values[0][0]


def test_busy_ranks_without_progress_are_not_stalled(ready):
    cell = "import time\nt = time.time()\nwhile time.time() - t < 5:\n    sum(range(1000))\nrank"
    ready.run_cell_magic("distrain", "--stall 2 -o res --framework torch", cell)
    assert ready.user_ns["res"].values == [0, 1]


def test_rank_0_alone_fails(ready):
    with pytest.raises(WorkerError) as info:
        ready.run_cell_magic(
            "distrain", "", train_cell(epochs=3, hook="if rank == 0 and step == 3: 1 / 0")
        )
    assert info.value.ranks == [0]
    assert "rank 0 (host" in str(info.value) and "ZeroDivisionError" in str(info.value)
