"""Ranks that disagree (uneven inputs, different collectives), Join, and the errors of jobs
nbdist had to kill: real local engines, real torch.distributed (gloo, CPU)."""

from __future__ import annotations

import textwrap
import time

import pytest

from nbdist import JobStalled, JobTimeout, RanksDisagree, WorkerError
from tests.cells import cell_in
from tests.fsdp import fully_shard_import

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

# 101 rows, each rank its own slice in batches of 5: rank 0 has 11 batches, rank 1 has 10.
UNEVEN = textwrap.dedent(
    """
    torch.manual_seed(0)
    X = torch.randn(101, 4)
    Y = X.sum(1, keepdim=True)
    xs, ys = X[rank::world_size], Y[rank::world_size]
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    LOOP
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xs[i : i + 5]), ys[i : i + 5])
        loss.backward()
        opt.step()
        steps += 1
    print("done", steps)
    steps, [p.detach().clone() for p in model.parameters()]
    """
)
LOOP = "for i in range(0, len(xs), 5):"
# The same loop under Join: ranks that run out of batches shadow the others' all-reduces.
JOINED = (
    "from torch.distributed.algorithms import Join\n"
    "with Join([model]):\n"
    "  for i in range(0, len(xs), 5):"
)


# What the uneven loop's RanksDisagree says, when the finished rank freed the waiting one.
FREED = (
    "no progress for 3 s: rank 1 finished the cell after 10 steps, while rank 0 waits at "
    "step 10 in DDP's gradient all-reduce in backward() (CELL, line 13: loss.backward()): a "
    "collective that rank 1 will never join. The ranks ran different numbers of steps: give "
    "every rank the same number of batches (DistributedSampler pads; drop_last=True), or "
    "wrap the loop in torch.distributed.algorithms.Join. nbdist freed rank 0 without killing "
    "it: the engines are the same."
)


def uneven(loop: str = LOOP) -> str:
    return UNEVEN.replace("LOOP", loop)


def _pids(magics) -> list[int]:
    return [e.pid for e in magics.cluster.engines]


def test_uneven_inputs_are_named_and_the_waiting_rank_freed(ready, magics):
    pids = _pids(magics)
    start = time.monotonic()
    with pytest.raises(RanksDisagree) as info:
        ready.run_cell_magic("distrain", "--stall 3", uneven())
    elapsed = time.monotonic() - start
    print(info.value)
    assert str(info.value).splitlines()[0] == FREED.replace("CELL", cell_in(ready))
    assert elapsed < 3 + 5
    assert _pids(magics) == pids
    ready.run_cell_magic("distrain", "-o res", "dist.all_reduce(t := torch.ones(1))\nt.item()\n")
    assert ready.user_ns["res"].values == [2.0, 2.0]
    assert _pids(magics) == pids


# FSDP2 sharding then a few steps: fully_shard's DeviceMesh, kept by DTensor's caches, held a
# reference to the process group, so a finished rank's destroy left its connections open.
FSDP2 = textwrap.dedent(
    """
    FULLY_SHARD_IMPORT
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    type(model[0].weight).__name__
    """
)


def test_uneven_inputs_after_an_fsdp2_cell_free_the_waiting_rank(ready, magics):
    fsdp2 = FSDP2.replace("FULLY_SHARD_IMPORT\n", fully_shard_import())
    ready.run_cell_magic("distrain", "-o res", fsdp2)
    assert ready.user_ns["res"].values == ["DTensor", "DTensor"]
    pids = _pids(magics)
    with pytest.raises(RanksDisagree) as info:
        ready.run_cell_magic("distrain", "--stall 3", uneven())
    assert str(info.value).splitlines()[0] == FREED.replace("CELL", cell_in(ready))
    assert _pids(magics) == pids
    # The new group serves both FSDP2 and plain collectives, still on the same engines.
    ready.run_cell_magic("distrain", "-o res", fsdp2)
    assert ready.user_ns["res"].values == ["DTensor", "DTensor"]
    ready.run_cell_magic("distrain", "-o res", "dist.all_reduce(t := torch.ones(1))\nt.item()\n")
    assert ready.user_ns["res"].values == [2.0, 2.0]
    assert _pids(magics) == pids


def test_join_lets_the_uneven_loop_finish_on_every_rank(ready):
    ready.run_cell_magic("distrain", "-o res --stall 10", uneven(JOINED))
    (steps0, params0), (steps1, params1) = ready.user_ns["res"].values
    assert (steps0, steps1) == (11, 10)
    assert all(torch_equal(a, b) for a, b in zip(params0, params1, strict=True))


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_ranks_in_different_collectives_are_named(ready, magics):
    cell = "if rank == 0:\n    dist.barrier()\nelse:\n    dist.all_reduce(torch.ones(1))\n"
    pids = _pids(magics)
    with pytest.raises(RanksDisagree) as info:
        ready.run_cell_magic("distrain", "--stall 3", cell)
    assert str(info.value).splitlines()[0] == (
        "no progress for 3 s: the ranks wait in different collectives: rank 0 waits before its "
        f"first step in torch.distributed.barrier ({cell_in(ready)}, line 3: dist.barrier()); "
        "rank 1 waits before its first step in torch.distributed.all_reduce "
        f"({cell_in(ready)}, line 5: "
        "dist.all_reduce(torch.ones(1))). Every rank must call the same collectives in the same "
        "order: look for a collective under `if rank == ...`, or in a loop whose length differs "
        "between ranks. Ranks 0, 1 could not be freed and had to be killed."
    )
    # Neither rank can leave the group while both wait: killing them is the only way out.
    assert not set(pids) & set(_pids(magics))
    ready.run_cell_magic("distrain", "-o res", "dist.get_world_size()\n")
    assert ready.user_ns["res"].values == [2, 2]


# A rank that ignores SIGINT and sleeps can only be killed: the error must still name the cause
# (the timeout, the stall, the rank that raised), never WorkerDied for the ranks nbdist killed.
DEAF = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(3600)"


def _killed_and_replaced(ready, magics, pids) -> None:
    assert not set(pids) & set(_pids(magics))
    ready.run_cell_magic("distrain", "-o res", "dist.get_world_size()\n")
    assert ready.user_ns["res"].values == [2, 2]


def test_killed_on_timeout_is_a_timeout(ready, magics):
    pids = _pids(magics)
    cell = f"if rank == 0:\n    {DEAF.replace(chr(10), chr(10) + '    ')}\ndist.barrier()\n"
    with pytest.raises(JobTimeout) as info:
        ready.run_cell_magic("distrain", "--timeout 2", cell)
    assert type(info.value) is JobTimeout
    assert str(info.value).splitlines() == [
        "the job ran past --timeout 2 s; stopped ranks 0, 1. Raise --timeout or make the cell "
        "shorter.",
        "The engines were replaced, and the workers' variables went with them: re-run the cells "
        "that build them.",
    ]
    _killed_and_replaced(ready, magics, pids)


def test_killed_on_stall_is_a_stall(ready, magics):
    pids = _pids(magics)
    cell = (
        "for step in range(100):\n    log(step, loss=1.0)\n    if rank == 1 and step == 5:\n"
        f"        {DEAF.replace(chr(10), chr(10) + '        ')}\n"
        "    dist.all_reduce(torch.ones(1))\n"
    )
    with pytest.raises(JobStalled) as info:
        ready.run_cell_magic("distrain", "--stall 3", cell)
    assert type(info.value) is JobStalled
    first = str(info.value).splitlines()[0]
    assert first.startswith(
        f"no progress for 3 s: rank 1 is stuck at step 5 ({cell_in(ready)}, line 7: "
        "time.sleep(3600)) (no progress for "
    )
    assert first.endswith(
        f" s); rank 0 waits at step 5 in torch.distributed.all_reduce ({cell_in(ready)}, line 8: "
        "dist.all_reduce(torch.ones(1))). Stopped ranks 0, 1. Look for what the stuck rank waits "
        "for (a collective the other ranks skipped, a sleep, a deadlock), or allow longer pauses "
        "with --stall S."
    )
    _killed_and_replaced(ready, magics, pids)


def test_killed_after_a_worker_error_is_that_error(ready, magics):
    pids = _pids(magics)
    cell = f"if rank == 1:\n    raise ValueError('bad batch')\n{DEAF}\n"
    with pytest.raises(WorkerError) as info:
        ready.run_cell_magic("distrain", "", cell)
    err = info.value
    assert err.ranks == [1] and err.stopped == [0]
    assert str(err).splitlines()[:2] == [
        "rank 1 (host " + err.failures[0].host + ") raised ValueError: bad batch",
        f"  at {cell_in(ready)}, line 3: raise ValueError('bad batch')",
    ]
    assert "rank 0 stopped because a peer failed." in err._render_traceback_()
    _killed_and_replaced(ready, magics, pids)
