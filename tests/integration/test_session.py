"""The distributed session on real engines: variables kept from cell to cell, REPL values,
failure semantics, the session's line magics, --on, --fresh, auto mode, display()."""

from __future__ import annotations

import time

import psutil
import pytest
from IPython.core.error import UsageError

from nbdist import JobStalled, JobTimeout, WorkerError
from nbdist.kernel.result import PerRank

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

BUILD = """
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(10, 32), nn.ReLU(),
                                                          nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank)
X = torch.randn(256, 10, generator=g)
Y = X.sum(1, keepdim=True)
losses = []
"""
TRAIN = """
for step in range(30):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(X), Y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
sum(losses[-5:]) / 5
"""


def _rss(magics) -> list[int]:
    return [psutil.Process(e.pid).memory_info().rss for e in magics.cluster.engines]


def test_three_cell_ddp_session_stays_in_sync_and_keeps_learning(fresh_session, magics):
    sh = fresh_session
    assert sh.run_cell_magic("distrain", "", BUILD) is None
    means = []
    for _ in range(3):
        means.append(sh.run_cell_magic("distrain", "--no-plot", TRAIN))
        assert isinstance(means[-1], PerRank)  # each rank's own data: the losses differ
        same = sh.run_line_magic("distrain", "compare model")
        assert same.identical and same.max_abs_diff == 0.0 and same.entries == 4
    for rank in (0, 1):
        assert means[0][rank] > means[1][rank] > means[2][rank]
    assert magics.session.variables == ["X", "Y", "g", "loss", "losses", "model", "opt", "step"]


def test_plain_cells_values_and_the_px_namespace(fresh_session, magics, capsys):
    sh = fresh_session
    assert sh.run_cell_magic("distrain", "", "print(f'hello from rank {rank}')\nx = 41\n") is None
    assert "[rank 0] hello from rank 0\n[rank 1] hello from rank 1\n" in capsys.readouterr().out
    assert sh.run_cell_magic("distrain", "", "x + 1") == 42  # equal on every rank: one value
    per_rank = sh.run_cell_magic("distrain", "", "rank * 10")
    assert isinstance(per_rank, PerRank) and list(per_rank) == [0, 10]
    assert repr(per_rank) == "[rank 0] 0\n[rank 1] 10"
    assert sh.run_cell_magic("distrain", "", "x;") is None  # ';' hides the value, as in IPython
    # The same namespace as ipyparallel's %%px and view.pull.
    assert magics.cluster._client[:].pull("x", block=True) == [41, 41]
    # --fresh neither sees nor leaves variables.
    with pytest.raises(WorkerError, match="NameError: name 'x' is not defined"):
        sh.run_cell_magic("distrain", "--fresh", "x\n")
    sh.run_cell_magic("distrain", "--fresh", "only_here = 1\n")
    with pytest.raises(WorkerError, match="name 'only_here' is not defined"):
        sh.run_cell_magic("distrain", "", "only_here\n")


def test_error_on_every_rank_keeps_the_variables(fresh_session):
    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD)
    with pytest.raises(WorkerError) as info:
        sh.run_cell_magic("distrain", "", "y = 1\nmodel(torch.randn(3, 7))\n")  # a shape error
    assert info.value.ranks == [0, 1]
    assert str(info.value).endswith(
        "The workers' variables are kept (X, Y, g, losses, model, opt, y), as after an error in "
        "a Python REPL; fix the cell and run it again."
    )
    assert sh.run_cell_magic("distrain", "", "y") == 1
    assert isinstance(sh.run_cell_magic("distrain", "--no-plot", TRAIN), PerRank)


KEPT = (
    "The process group was rebuilt and every rank kept its variables (X, Y, g, loss, losses, "
    "model, opt, step); the next cell wraps model in DistributedDataParallel again."
)


def test_failure_mid_allreduce_rebuilds_the_group_around_the_variables(fresh_session, magics):
    """Rank 1 raises at step 3 while rank 0 waits in that step's gradient all-reduce: neither
    stepped, the group is rebuilt, and every rank keeps its model, which trains on."""
    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD)
    sh.run_cell_magic("distrain", "--no-plot", TRAIN)
    cell = TRAIN.replace("    opt.zero_grad()", "    if rank == 1 and step == 3:\n        1 / 0\n"
                         "    opt.zero_grad()")  # fmt: skip
    pids = [e.pid for e in magics.cluster.engines]
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        sh.run_cell_magic("distrain", "--no-plot", cell)
    assert time.monotonic() - start < 10
    assert info.value.ranks == [1]
    assert str(info.value).endswith(KEPT + " model is the same on every rank.")
    assert [e.pid for e in magics.cluster.engines] == pids  # freed, not killed
    assert magics.session.variables == ["X", "Y", "g", "loss", "losses", "model", "opt", "step"]
    # 30 steps, then 3 more on each rank (their losses appended before the error).
    assert sh.run_cell_magic("distrain", "", "len(losses)") == 33
    # The group is new: an --on cell sets it up with the ranks it leaves out, and both wrap
    # the model in DDP again.
    start = time.monotonic()
    assert sh.run_cell_magic(
        "distrain", "--on 0 --stall 5", "(dist.get_world_size(), type(model).__name__)"
    ) == (2, "DistributedDataParallel")
    assert time.monotonic() - start < 5
    means = sh.run_cell_magic("distrain", "--no-plot", TRAIN)
    assert all(m < losses for m, losses in zip(means, _losses_at(sh, 29), strict=True))
    assert sh.run_line_magic("distrain", "compare model").identical


def _losses_at(sh, i: int) -> list[float]:
    return list(sh.run_cell_magic("distrain", "", f"losses[{i}]"))


def test_a_rank_a_step_behind_after_an_error_is_named_and_synced(fresh_session, magics, capsys):
    """Rank 1 raises between its backward and its optimizer step: rank 0 took step 3, rank 1
    did not. The error says the replicas differ and how to make them agree."""
    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD)
    cell = TRAIN.replace("    opt.step()", "    if rank == 1 and step == 3:\n        1 / 0\n"
                         "    opt.step()")  # fmt: skip
    with pytest.raises(WorkerError) as info:
        sh.run_cell_magic("distrain", "--no-plot", cell)
    assert str(info.value).endswith(
        KEPT + " The replicas differ from rank 0's (model on rank 1): a rank that raised or was "
        "stopped mid-step can be a step behind. %distrain sync model,opt gives every rank rank "
        "0's; %distrain compare model shows the difference."
    )
    assert not sh.run_line_magic("distrain", "compare model").identical
    capsys.readouterr()
    sh.run_line_magic("distrain", "sync model,opt")
    assert capsys.readouterr().out == (
        "nbdist: every rank has rank 0's model, opt now (model, opt loaded in place)\n"
    )
    for name in ("model", "opt"):
        assert sh.run_line_magic("distrain", f"compare {name}").identical
    sh.run_cell_magic("distrain", "--no-plot", TRAIN)
    assert sh.run_line_magic("distrain", "compare model").identical


def test_an_error_on_one_rank_with_the_others_done_keeps_the_variables(fresh_session, magics):
    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD)
    with pytest.raises(WorkerError) as info:
        sh.run_cell_magic("distrain", "", "if is_main:\n    model.wieght\n")
    assert info.value.ranks == [0]
    assert str(info.value).endswith("fix the cell and run it again.")
    assert "model" in magics.session.variables
    # --backend gloo is the group these cells already have: nothing is rebuilt.
    assert isinstance(sh.run_cell_magic("distrain", "--backend gloo --no-plot", TRAIN), PerRank)


def test_reset_gives_the_memory_back(fresh_session, magics, capsys):
    sh = fresh_session
    before = _rss(magics)
    sh.run_cell_magic("distrain", "", "big = torch.ones(64 * 2**20)\nbig.sum().item()")  # 256 MB
    grown = _rss(magics)
    assert all(g - b > 200 * 2**20 for g, b in zip(grown, before, strict=True))
    sh.run_line_magic("distrain", "reset")
    assert "nbdist: reset: dropped big on every worker" in capsys.readouterr().out
    after = _rss(magics)
    assert all(a < 1.1 * b for a, b in zip(after, before, strict=True)), (before, grown, after)
    with pytest.raises(WorkerError, match="name 'big' is not defined"):
        sh.run_cell_magic("distrain", "", "big\n")


@pytest.mark.slow
def test_soak_25_cells_reassigning_the_model(fresh_session, magics):
    sh = fresh_session
    cell = BUILD + TRAIN.replace("range(30)", "range(3)")
    for _ in range(5):  # warm-up: allocator pools and lazy imports settle
        sh.run_cell_magic("distrain", "--no-plot", cell)
    before = _rss(magics)
    for _ in range(25):
        sh.run_cell_magic("distrain", "--no-plot", cell)
    after = _rss(magics)
    assert all(a - b < 20 * 2**20 for a, b in zip(after, before, strict=True)), (before, after)


def test_on_some_ranks(fresh_session, magics):
    sh = fresh_session
    sh.run_cell_magic("distrain", "", "x = rank\n")
    assert sh.run_cell_magic("distrain", "--on 1", "x * 100") == 100
    sh.run_cell_magic("distrain", "--on 1", "x = 7\n")
    assert list(sh.run_cell_magic("distrain", "", "x")) == [0, 7]
    start = time.monotonic()
    with pytest.raises(JobStalled) as info:
        sh.run_cell_magic("distrain", "--on 0 --stall 3", "dist.all_reduce(torch.ones(1))\n")
    assert time.monotonic() - start < 3 + 5
    assert str(info.value).startswith(
        "no progress for 3 s: rank 0 waits in a collective that needs every rank, but --on ran "
        "only ranks 0."
    )
    assert str(info.value).endswith(
        "The process group was rebuilt and every rank kept its variables (x)."
    )
    assert sh.run_cell_magic("distrain", "", "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == 2
    pids = [e.pid for e in magics.cluster.engines]
    with pytest.raises(JobTimeout, match="ran past --timeout 2 s"):
        sh.run_cell_magic("distrain", "--on 0 --timeout 2", "dist.all_reduce(torch.ones(1))\n")
    assert [e.pid for e in magics.cluster.engines] == pids  # freed by rank 1, not killed
    assert sh.run_cell_magic("distrain", "", "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == 2
    with pytest.raises(UsageError, match="--on 5 does not exist; ranks go from 0 to 1"):
        sh.run_cell_magic("distrain", "--on 5", "x = 1\n")


def test_line_magics_pull_push_vars_status_restart(fresh_session, magics, capsys):
    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD + "w = rank + 0.5\n")
    sh.run_line_magic("distrain", "pull w --rank 1")
    assert sh.user_ns["w"] == 1.5
    sh.user_ns["cfg"] = {"lr": 0.5}
    sh.run_line_magic("distrain", "push cfg")
    assert sh.run_cell_magic("distrain", "", "cfg['lr']") == 0.5
    with pytest.raises(UsageError, match="pull: rank 0: NameError: no variable 'nope'"):
        sh.run_line_magic("distrain", "pull nope")
    sh.run_cell_magic("distrain", "", "import threading\nlock = threading.Lock()\n")
    with pytest.raises(UsageError, match=r"lock is a lock, which cannot be sent.*lock.state_dict"):
        sh.run_line_magic("distrain", "pull lock")
    table = sh.run_line_magic("distrain", "vars")
    rows = {row.name: row for row in table.rows}
    assert rows["model"].params == 10 * 32 + 32 + 32 + 1 and rows["model"].same == "yes"
    assert rows["X"].shape == (256, 10) and rows["X"].same == "no (differs on rank 1)"
    assert rows["cfg"].same == "yes"
    capsys.readouterr()
    sh.run_line_magic("distrain", "status")
    out = capsys.readouterr().out
    assert "rank     memory  gpu memory  variables" in out
    count = len(magics.session.variables)
    assert out.rstrip().endswith(f"-  {count}")
    sh.run_line_magic("distrain", "restart")
    out = capsys.readouterr().out
    assert (
        "nbdist: the workers were restarted; their variables (X, Y, cfg, g, lock, losses, model, "
        "opt, w) are gone: re-run the cells that build them." in out
    )
    with pytest.raises(UsageError, match="compare: no variable 'model' on any worker"):
        sh.run_line_magic("distrain", "compare model")


def test_compare_finds_the_replica_that_drifted(fresh_session):
    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD)
    sh.run_cell_magic("distrain", "--on 1", "model.module[0].bias.data[0] += 1e-3\n")
    diff = sh.run_line_magic("distrain", "compare model")
    assert not diff.identical
    assert [d.entry for d in diff.differences] == ["module.0.bias"]
    assert diff.differences[0].ranks == (1,)
    assert diff.max_abs_diff == pytest.approx(1e-3, rel=1e-3)


def test_auto_mode_and_local_cells(fresh_session, magics, capsys):
    sh = fresh_session
    sh.run_line_magic("distrain", "auto on")
    try:
        sh.run_cell("on_workers = rank + 1\n")
        sh.run_cell("%%local\nhere = 'kernel'\n")
        assert "on_workers" not in sh.user_ns and sh.user_ns["here"] == "kernel"
        # A %%local cell is a cell of the kernel's own: top-level await, IPython's errors.
        done = sh.run_cell("%%local\nimport asyncio\nawait asyncio.sleep(0)\nslept = 1\n")
        assert done.success and sh.user_ns["slept"] == 1
        failed = sh.run_cell("%%local\n1 / 0\n")
        assert isinstance(failed.error_in_exec, ZeroDivisionError)
    finally:
        sh.run_line_magic("distrain", "auto off")
    sh.run_cell("after = 1\n")
    assert sh.user_ns["after"] == 1
    assert sh.run_cell_magic("distrain", "", "on_workers") == PerRank([1, 2], [0, 1])
    assert "after" not in magics.session.variables


def test_display_from_a_worker(fresh_session, magics):
    shown = []
    real = magics.session.publish
    magics.session.publish = lambda data, metadata: shown.append(data)
    try:
        fresh_session.run_cell_magic(
            "distrain",
            "",
            "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
            "from IPython.display import display, HTML\n"
            "if is_main:\n    fig, ax = plt.subplots()\n    ax.plot([1, 2, 3])\n    display(fig)\n"
            "display(HTML(f'<b>rank {rank}</b>'))\n",
        )
    finally:
        magics.session.publish = real
    assert shown[0] == {"text/plain": "[rank 0]"}
    assert shown[1]["image/png"].startswith("iVBOR") or shown[1]["image/png"][:4] == b"\x89PNG"
    assert shown[2]["text/html"] == "<b>rank 0</b>"
    assert shown[3] == {"text/plain": "[rank 1]"}
    assert shown[4]["text/html"] == "<b>rank 1</b>"
    assert len(shown) == 5


def test_interrupt_mid_training_without_steps_keeps_the_variables_and_the_session_goes_on(
    fresh_session, magics
):
    """With nothing the ranks could stop at together (--no-autolog: no step reported), the
    interrupt stops them where they are (the graceful stop: test_graceful_stop.py)."""
    import os
    import signal
    import threading

    from nbdist import JobInterrupted

    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD)
    pids = [e.pid for e in magics.cluster.engines]
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(JobInterrupted) as info:
        sh.run_cell_magic(
            "distrain", "--no-plot --no-autolog", TRAIN.replace("range(30)", "range(10**6)")
        )
    timer.join()
    assert str(info.value).startswith(
        "interrupted (Stop button or Kernel > Interrupt); stopped ranks 0, 1."
    )
    # The ranks were interrupted anywhere in a step: the replicas may differ by one.
    assert KEPT in str(info.value)
    assert [e.pid for e in magics.cluster.engines] == pids  # no engine had to be killed
    sh.run_line_magic("distrain", "sync model,opt")
    assert isinstance(sh.run_cell_magic("distrain", "--no-plot", TRAIN), PerRank)
    assert sh.run_line_magic("distrain", "compare model").identical


def test_the_value_is_the_cells_result(fresh_session):
    result = fresh_session.run_cell("%%distrain\nworld_size * 21\n")
    assert result.success and result.result == 42
    assert fresh_session.user_ns["_"] == 42  # Out[n] and _ as for any cell
