"""What the panel and the saved figure show for real runs: short runs, FSDP2, stragglers, and
a session's training cells continuing one curve (real engines, real torch.distributed, gloo)."""

from __future__ import annotations

import textwrap

import pytest

from tests.fsdp import fully_shard_import

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

MLP = textwrap.dedent(
    """
    torch.manual_seed(0)
    X = torch.randn(256, 16)
    Y = X @ torch.randn(16, 4)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    """
)

LOOP = textwrap.dedent(
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        xb, yb = X[rank::world_size][:32], Y[rank::world_size][:32]
        SLOW
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
    """
)


DDP = "model = nn.parallel.DistributedDataParallel(model)\n"


def loop(steps, slow="pass"):
    return LOOP.replace("STEPS", str(steps)).replace("SLOW", slow)


@pytest.fixture(scope="module")
def ready(shell):
    shell.run_line_magic("distrain", "start -n 2")
    shell.run_cell_magic("distrain", "-n 2 --framework torch", "x = 1\n")
    return shell


def _rate_lines(magics):
    fig = magics.session.view.figure
    return [(list(line.get_xdata()), fig.note.get_text()) for line in fig.ax_rate.get_lines()]


def test_a_one_second_run_draws_throughput_lines(ready, magics, capsys):
    cell = "import time\n" + MLP + DDP + loop(60, slow="time.sleep(0.015)")  # about 1 s
    ready.run_cell_magic("distrain", "-o res", cell)
    res = ready.user_ns["res"]
    assert {p["samples"] for p in res.history} == {32}
    for xs, note in _rate_lines(magics):  # total, rank 0, rank 1
        assert len(xs) >= 2 and note == ""
    assert "samples/s total" in capsys.readouterr().out


def test_fsdp2_counts_samples(ready, magics):
    cell = (
        fully_shard_import()
        + MLP
        + "for layer in model:\n    if isinstance(layer, nn.Linear):\n        fully_shard(layer)\n"
        + "fully_shard(model)\n"
        + loop(40)
    )
    ready.run_cell_magic("distrain", "-o res", cell)
    res = ready.user_ns["res"]
    for rank in (0, 1):
        points = [p for p in res.history if p["rank"] == rank]
        assert len(points) == 40
        assert [p.get("samples") for p in points] == [32] * 40  # once per step, not per layer
    assert all(len(xs) >= 2 for xs, _ in _rate_lines(magics))
    assert res.warnings == ()  # its all-gathers and reduce-scatters count as collectives


def test_the_rank_that_keeps_the_others_waiting_is_named(ready, capsys):
    cell = (
        "import time\n" + MLP + DDP
        + loop(40, slow="if rank == 1:\n            time.sleep(0.03)")
    )  # fmt: skip
    ready.run_cell_magic("distrain", "-o res", cell)
    out = capsys.readouterr().out
    summary = next(line for line in out.splitlines() if line.startswith("nbdist: final loss"))
    assert "rank 1 keeps the others waiting" in summary, summary
    res = ready.user_ns["res"]

    def per_rank(key):
        return {
            r: sorted(p[key] for p in res.history if p["rank"] == r and key in p) for r in (0, 1)
        }

    work, wait = per_rank("work"), per_rank("wait")
    # from the second step on (the first has no earlier sync), each joining the next point
    assert len(work[0]) == len(work[1]) == 38
    assert work[1][19] > 0.03 > work[0][19]  # medians: rank 1 sleeps, rank 0 does not
    assert wait[0][19] > 0.02 > wait[1][19]  # ...and rank 0 waits for it in the allreduce


def test_training_cells_of_a_session_continue_one_curve(ready, magics):
    ready.run_line_magic("distrain", "reset")
    ready.run_cell_magic("distrain", "", MLP + DDP)
    ready.run_cell_magic("distrain", "-o first", loop(30))
    ready.run_cell_magic("distrain", "-o second", loop(20))
    first, second = ready.user_ns["first"], ready.user_ns["second"]
    assert sorted({p["step"] for p in first.history}) == list(range(30))
    assert sorted({p["step"] for p in second.history}) == list(range(20))  # this cell's own
    curve = magics.session.curve
    assert [(seg.steps[0], seg.steps[-1]) for seg in curve] == [(0, 29), (30, 49)]
    faint = magics.session.view.figure.ax_loss.get_lines()[0]
    assert faint.get_label() == "earlier cells"
    assert [x for x in faint.get_xdata() if x == x] == list(range(30))
    ready.run_line_magic("distrain", "reset")
    assert magics.session.curve == []


def test_another_model_starts_a_curve_of_its_own(ready, magics):
    ready.run_line_magic("distrain", "reset")
    ready.run_cell_magic("distrain", "", MLP + DDP)
    ready.run_cell_magic("distrain", "", loop(30))
    first_key = magics.session.curve_key
    assert first_key.startswith("torch:")
    ready.run_cell_magic("distrain", "", MLP + DDP + loop(20))  # a new model object
    assert magics.session.curve_key != first_key
    assert [(seg.steps[0], seg.steps[-1]) for seg in magics.session.curve] == [(0, 19)]
    faint = magics.session.view.figure.ax_loss.get_lines()[0]
    assert list(faint.get_xdata()) == []  # no earlier cells drawn
    ready.run_cell_magic("distrain", "", loop(10))  # the same model trained further
    assert [(seg.steps[0], seg.steps[-1]) for seg in magics.session.curve] == [(0, 19), (20, 29)]


def test_a_short_cell_under_load_names_no_straggler(ready, capsys):
    """Tutorial 01's training cell, ten times, while two processes keep both cores busy."""
    import subprocess
    import sys

    cell = textwrap.dedent(
        """
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(10, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(64, 10), torch.randn(64, 1)
        for step in range(20):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[rank::world_size]), y[rank::world_size])
            loss.backward()
            opt.step()
        """
    )
    hog = "while True:\n    pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(2)]
    try:
        for _ in range(10):
            ready.run_cell_magic("distrain", "", cell)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    summaries = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("nbdist: final")
    ]
    assert len(summaries) == 10
    assert not [s for s in summaries if "waiting" in s], summaries


def test_a_model_prepared_by_accelerate_counts_samples(ready, magics):
    pytest.importorskip("accelerate")
    cell = (
        "from accelerate import Accelerator\n"
        "accelerator = Accelerator(cpu=True)\n"
        + MLP
        + "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        + "model, opt = accelerator.prepare(model, opt)\n"
        + "for step in range(30):\n"
        + "    xb, yb = X[rank::world_size][:32], Y[rank::world_size][:32]\n"
        + "    opt.zero_grad()\n"
        + "    loss = nn.functional.mse_loss(model(xb), yb)\n"
        + "    accelerator.backward(loss)\n"
        + "    opt.step()\n"
        + "(accelerator.num_processes, type(model).__name__)\n"
    )
    ready.run_cell_magic("distrain", "-o res", cell)
    res = ready.user_ns["res"]
    assert res.values == [(2, "DistributedDataParallel")] * 2
    for rank in (0, 1):
        points = [p for p in res.history if p["rank"] == rank]
        assert [p.get("samples") for p in points] == [32] * 30
    assert all(len(xs) >= 2 for xs, _ in _rate_lines(magics))
