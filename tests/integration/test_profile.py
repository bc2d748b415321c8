"""%%distrain --profile on real engines with a real gloo group: where each rank's step goes.

One rank is made slow with extra work each step (a matrix product, computation the profiler
sees): its computation share rises, and the fast rank waits for it in DDP's all-reduce.
"""

from __future__ import annotations

import os

import pytest
from IPython.core.error import UsageError

from nbdist.kernel.breakdown import PARTS, trace_events

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

BUILD = """
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(),
                                                          nn.Linear(256, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
X, Y = torch.randn(128, 64, generator=g), torch.randn(128, 8, generator=g)
"""
# Rank 1 does extra work before each backward: the fast rank 0 reaches the all-reduce first.
TRAIN = """
for step in range(STEPS):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(X), Y)
    if rank == SLOW:
        a = torch.randn(300, 300)
        for _ in range(WORK):
            a = a @ a / 300
    loss.backward()
    opt.step()
"""


def _run(shell, flags: str, *, slow: int, work: int, steps: int = 10):
    shell.user_ns.update(SLOW=slow, WORK=work, STEPS=steps)
    shell.run_cell_magic("distrain", flags + " --push SLOW,WORK,STEPS", TRAIN)
    return shell.user_ns["res"]


def test_a_slow_rank_computes_more_and_its_peer_waits(fresh_session, capsys, monkeypatch, tmp_path):
    sh = fresh_session
    monkeypatch.chdir(tmp_path)  # the traces go under the notebook's folder
    sh.run_cell_magic("distrain", "", BUILD)
    capsys.readouterr()
    res = _run(sh, "--profile 4 -o res", slow=1, work=30)
    out = capsys.readouterr().out
    profile = res.profile
    assert profile is not None and profile.device == "cpu" and profile.skipped == 2
    fast, slow = profile.ranks
    assert fast.steps == slow.steps == 4
    for r in profile.ranks:
        parts = sum(getattr(r, f"{p}_ms") for p in PARTS)
        assert abs(parts - r.step_ms) <= 0.05 * r.step_ms, (r, parts)
        assert r.top_ops and r.top_ops[0][1] > 0
    assert slow.share("compute") > fast.share("compute")
    assert fast.share("waiting") > slow.share("waiting")
    assert fast.waiting_ms > 0.5 * (slow.compute_ms - fast.compute_ms)
    assert slow.top_ops[0][0] in ("aten::mm", "aten::matmul", "aten::div")
    # Shown under the figure: the table, the top operators, where the traces are.
    assert "nbdist: profile of 4 steps per rank (after 2 warm-up steps; cpu)" in out
    assert profile.table() in out
    traces = f"Chrome traces (open in https://ui.perfetto.dev or TensorBoard): {profile.folder}/"
    assert traces in out
    for r in profile.ranks:
        events = trace_events(r.trace)
        names = {e.get("name") for e in events}
        assert "gloo:all_reduce" in names and any(n.startswith("ProfilerStep") for n in names)

    # The same cell the other way round: the roles swap.
    res = _run(sh, "--profile 3 -o res --no-plot", slow=0, work=30)
    r0, r1 = res.profile.ranks
    assert r0.steps == 3 and r0.share("compute") > r1.share("compute")
    assert r1.share("waiting") > r0.share("waiting")
    # Without --profile nothing is profiled, and the model trained on in between.
    res = _run(sh, "-o res --no-plot", slow=0, work=0)
    assert res.profile is None
    assert sh.run_line_magic("distrain", "compare model").identical


def test_too_few_steps_say_so(fresh_session, capsys, monkeypatch, tmp_path):
    sh = fresh_session
    monkeypatch.chdir(tmp_path)
    sh.run_cell_magic("distrain", "", BUILD)
    capsys.readouterr()
    res = _run(sh, "--profile -o res --no-plot", slow=0, work=0, steps=2)
    assert res.profile is None
    assert (
        "nbdist: --profile: no step was profiled on rank 0: the window opens after 2 optimizer "
        "steps (optimizer.step() calls); run more steps in the cell"
    ) in capsys.readouterr().out
    assert not os.path.exists("nbdist-profile")


def test_profile_is_a_usage_error_for_tensorflow_cells(shell):
    with pytest.raises(UsageError, match=r"--profile is not available for TensorFlow cells: "):
        shell.run_cell_magic("distrain", "--profile --framework tf", "model.fit(x, y)\n")
    with pytest.raises(UsageError, match=r"expected a number of steps, e\.g\. --profile 5"):
        shell.run_cell_magic("distrain", "--profile many", "pass\n")


SCAN_CELL = """
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(),
                                                          nn.Linear(256, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, Y = torch.randn(128, 64), torch.randn(128, 8)
for step in range(8):
    opt.zero_grad()
    nn.functional.mse_loss(model(X), Y).backward()
    opt.step()
"""


def test_a_scan_profiles_each_worker_count(shell, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    scan = shell.run_cell_magic("distrain", "--scan 1,2 --profile 3 --no-plot", SCAN_CELL)
    one, two = scan.profiles
    assert [len(one.ranks), len(two.ranks)] == [1, 2]
    assert all(r.steps == 3 for p in scan.profiles for r in p.ranks)
    # One worker has nobody to wait for.
    assert one.ranks[0].waiting_ms == 0.0
    table = scan.table()
    assert table.splitlines()[0].endswith("compute   comm  waiting  other")
    assert table in capsys.readouterr().out


FSDP2_CELL = """
from torch.distributed.device_mesh import init_device_mesh
torch.manual_seed(0)
sharded = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
mesh = init_device_mesh("cpu", (world_size,))
for layer in (sharded[0], sharded[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)
opt = torch.optim.Adam(sharded.parameters(), lr=1e-3)
X = torch.randn(128, 64)
for step in range(8):
    opt.zero_grad()
    nn.functional.mse_loss(sharded(X), X[:, :8]).backward()
    opt.step()
"""


def test_fsdp2_collectives_are_communication(fresh_session, monkeypatch, tmp_path):
    """FSDP2 all-gathers its shards and reduce-scatters the gradients: on gloo both show as
    collectives of their own, and count as communication or waiting."""
    from tests.fsdp import fully_shard_import

    monkeypatch.chdir(tmp_path)
    sh = fresh_session
    sh.run_cell_magic("distrain", "--profile 3 --no-plot -o res", fully_shard_import() + FSDP2_CELL)
    profile = sh.user_ns["res"].profile
    for r in profile.ranks:
        assert r.steps == 3
        assert r.communication_ms + r.overlapped_ms + r.waiting_ms > 0
        names = {e.get("name") for e in trace_events(r.trace)}
        assert "gloo:all_gather" in names, sorted(n for n in names if n and "gloo" in n)
