"""Stop keeps your model: every rank stops at the same step boundary, the session goes on.

Each interrupt is a real SIGINT to this process (the Stop button asks the Jupyter server for
the same), on real engines with a real gloo group.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from nbdist import JobInterrupted
from nbdist.kernel.job import GRACEFUL_WAIT_S
from tests.fsdp import fully_shard_import
from tests.procs import once, once_written, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

BUILD = """
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(10, 32), nn.ReLU(),
                                                          nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
X = torch.randn(256, 10, generator=g)
Y = X.sum(1, keepdim=True)
done = 0
"""
# A loop that would run for hours; each step sleeps, as a real step computes.
TRAIN = """
import time
for step in range(10**6):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(X), Y)
    loss.backward()
    time.sleep(STEP_S)
    opt.step()
    done += 1
"""


def _train(step_s: float = 0.02, steps: int = 10**6) -> str:
    return TRAIN.replace("STEP_S", str(step_s)).replace("10**6", str(steps))


KEPT = (
    "The workers' variables are kept and the process group stays: the next cell continues "
    "from there (%distrain compare model checks the replicas)."
)


def _interrupt_at(*seconds: float, sent: list[float] | None = None) -> threading.Thread:
    """SIGINT to this process ``seconds`` after now; each one's time appended to ``sent``."""

    def send() -> None:
        start = time.monotonic()
        for t in seconds:
            time.sleep(max(0.0, start + t - time.monotonic()))
            if sent is not None:
                sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def _both_seen_stepping(magics):
    """Whether the notebook has a point from both ranks of the cell that now starts: a graceful
    stop needs one (a rank's step boundary); an interrupt before any is an interrupt at once."""
    before = magics.session.view

    def seen() -> bool:
        view = magics.session.view
        return view is not None and view is not before and view.agg.seen >= 2

    return seen


def _stopped_step(message: str) -> int:
    """The steps every rank took, as the message says them: after step N (numbered from 0, as
    the panel numbers them), N + 1 steps taken."""
    said = re.match(
        r"stopped \(Stop button or Kernel > Interrupt\): every rank stopped after step (\d+)"
        r"(?: of this cell, \d+ in the session)? \((\d+) steps? taken\)\.",
        message,
    )
    assert said and int(said.group(2)) == int(said.group(1)) + 1, message
    return int(said.group(2))


def test_stop_keeps_the_model_and_the_next_cell_trains_on(fresh_session, magics, capsys):
    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD)
    pids = [e.pid for e in magics.cluster.engines]
    sent: list[float] = []
    sender = once(_both_seen_stepping(magics), lambda: _interrupt_at(0.0, sent=sent).join())
    with pytest.raises(JobInterrupted) as info:
        sh.run_cell_magic("distrain", "--no-plot", _train(step_s=0.5))  # the slowest steps promised
    took = time.monotonic() - sent[0]
    sender.join()
    message = str(info.value)
    steps = _stopped_step(message)
    # The first cell that trains this model: one count, the cell's.
    taken = f"{steps} step{'s' if steps != 1 else ''} taken"
    assert message.endswith(f"after step {steps - 1} ({taken}).\n{KEPT}"), message
    assert steps >= 1
    assert took < 2.0  # within 2 s of the click (not the fallback's wait)
    assert magics.session.view.stopping_step == steps  # what the Stop button said meanwhile
    # Every rank took the same number of optimizer steps, the replicas are identical, and the
    # variables (the cell's new ones too) are all there.
    assert sh.run_cell_magic("distrain", "", "done") == steps
    same = sh.run_line_magic("distrain", "compare model")
    assert same.identical and same.max_abs_diff == 0.0
    assert magics.session.variables == ["X", "Y", "done", "g", "loss", "model", "opt", "step"]
    assert [e.pid for e in magics.cluster.engines] == pids
    # The next cell trains on, from there, on the same group; its steps continue the session's
    # curve, and the summary gives both counts.
    capsys.readouterr()
    sh.run_cell_magic("distrain", "--no-plot", _train(steps=5))
    assert (
        f"(mean over ranks; step 4 of this cell, {steps + 4} in the session) · "
        in capsys.readouterr().out
    )
    assert sh.run_cell_magic("distrain", "", "done") == steps + 5
    assert sh.run_line_magic("distrain", "compare model").identical


def test_fsdp2_stops_at_the_same_step(fresh_session, magics):
    sh = fresh_session
    sh.run_cell_magic(
        "distrain",
        "",
        fully_shard_import() + "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))\n"
        "for layer in model:\n    if isinstance(layer, nn.Linear):\n        fully_shard(layer)\n"
        "fully_shard(model)\n"
        "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
        "X = torch.randn(64, 10, generator=torch.Generator().manual_seed(rank))\n"
        "Y = X.sum(1, keepdim=True)\ndone = 0\n",
    )
    sender = once(_both_seen_stepping(magics), lambda: _interrupt_at(0.0).join())
    with pytest.raises(JobInterrupted) as info:
        sh.run_cell_magic("distrain", "--no-plot", _train())
    sender.join()
    steps = _stopped_step(str(info.value))
    assert str(info.value).endswith(KEPT)
    assert sh.run_cell_magic("distrain", "", "done") == steps
    # Adam's step count is the same on every rank: each took the update, or none did.
    same_steps = sh.run_cell_magic(
        "distrain", "", "int(next(iter(opt.state.values()))['step'].item())"
    )
    assert same_steps == steps
    sh.run_cell_magic("distrain", "--no-plot", _train(steps=3))
    assert sh.run_cell_magic("distrain", "", "done") == steps + 3


# Logs once (a step boundary the run counts), then reaches none again.
NO_MORE_STEPS = "log(loss=1.0)\nimport time\nwhile True:\n    time.sleep(0.01)\n"


def test_a_rank_that_reaches_no_step_boundary_is_interrupted_after_the_wait(fresh_session, magics):
    sh = fresh_session
    sh.run_cell_magic("distrain", "", "x = 1\n")
    # One that came before the ranks' logged point would find that step boundary still ahead.
    sent: list[float] = []
    sender = once(_both_seen_stepping(magics), lambda: _interrupt_at(0.0, sent=sent).join())
    with pytest.raises(JobInterrupted) as info:
        sh.run_cell_magic("distrain", "--no-plot", NO_MORE_STEPS)
    took = time.monotonic() - sent[0]
    sender.join()
    assert str(info.value) == (
        "interrupted (Stop button or Kernel > Interrupt); stopped ranks 0, 1. Asked to stop at "
        f"a step boundary, ranks 0-1 reached none within {GRACEFUL_WAIT_S:g} s (a loop with no "
        "optimizer.step() or log() call, a rank blocked in a data loader or a collective), so "
        "the ranks were interrupted.\n"
        "The process group was rebuilt and every rank kept its variables (x)."
    )
    assert GRACEFUL_WAIT_S <= took < GRACEFUL_WAIT_S + 4.0  # from the interrupt


def test_a_rank_blocked_in_a_collective_falls_back_to_the_interrupt(
    fresh_session, magics, tmp_path
):
    """Rank 1 stops stepping (a sleep standing in for a stuck data loader) and rank 0 waits for
    it in DDP's all-reduce: neither reaches a boundary, the interrupt frees both."""
    sh = fresh_session
    sh.run_cell_magic("distrain", "", BUILD)
    stuck_file = tmp_path / "stuck"  # written by rank 1 when it stops stepping
    stuck = _train(step_s=0.01).replace(
        "    time.sleep(0.01)\n",
        "    if rank == 1 and step == 20:\n"
        f"        open({str(stuck_file)!r}, 'w').close()\n"
        "        time.sleep(3600)\n"
        "    time.sleep(0.01)\n",
    )
    sent: list[float] = []
    # 0.2 s after rank 1 stuck: rank 0 is then waiting for it in the all-reduce.
    sender = once_written([stuck_file], lambda: _interrupt_at(0.2, sent=sent).join())
    with pytest.raises(JobInterrupted) as info:
        sh.run_cell_magic("distrain", "--no-plot", stuck)
    took = time.monotonic() - sent[0]
    sender.join()
    message = str(info.value)
    assert message.startswith(
        "interrupted (Stop button or Kernel > Interrupt); stopped ranks 0, 1. Asked to stop at "
        f"a step boundary, ranks 0-1 reached none within {GRACEFUL_WAIT_S:g} s"
    ), message
    # Interrupted wherever each was: they may be a step apart, and the line says whether.
    assert message.splitlines()[-1].startswith(
        "The process group was rebuilt and every rank kept its variables (X, Y, done, g, loss, "
        "model, opt, step); the next cell wraps model in DistributedDataParallel again."
    ), message
    assert took < GRACEFUL_WAIT_S + 5.0  # the wait, then the interrupt's own bound
    # The session goes on, on a new group, from the steps each rank had done.
    before = list(sh.run_cell_magic("distrain", "", "done"))
    sh.run_line_magic("distrain", "sync model,opt")
    sh.run_cell_magic("distrain", "--no-plot", _train(steps=3))
    assert list(sh.run_cell_magic("distrain", "", "done")) == [d + 3 for d in before]
    assert sh.run_line_magic("distrain", "compare model").identical


def test_a_second_interrupt_while_the_stop_waits_interrupts_at_once(fresh_session, magics):
    sh = fresh_session
    # The first interrupt once a graceful stop is possible (its wait begins), the second 0.5 s on.
    sent: list[float] = []
    sender = once(_both_seen_stepping(magics), lambda: _interrupt_at(0.0, 0.5, sent=sent).join())
    with pytest.raises(JobInterrupted) as info:
        sh.run_cell_magic("distrain", "--no-plot", NO_MORE_STEPS)
    took = time.monotonic() - sent[0]
    sender.join()
    assert str(info.value).startswith(
        "interrupted (Stop button or Kernel > Interrupt); stopped ranks 0, 1.\n"
    )
    assert took < GRACEFUL_WAIT_S  # the second did not wait for the first's wait to end


def test_a_cell_with_no_step_boundary_is_interrupted_at_once(fresh_session):
    sender = _interrupt_at(1.5)
    start = time.monotonic()
    with pytest.raises(JobInterrupted, match=r"^interrupted \(Stop button"):
        fresh_session.run_cell_magic(
            "distrain", "--no-plot", "import time\nwhile True:\n    time.sleep(0.01)\n"
        )
    sender.join()
    assert time.monotonic() - start < 1.5 + GRACEFUL_WAIT_S


def test_the_stop_signal_sent_to_every_process_of_the_engines_ends_none(shell, magics):
    """Slurm sends its time-limit warning (the stop signal, USR1) to every process of the job
    step: ipyparallel's nanny, which each engine starts as it registers, too. A nanny that died
    of it failed the engine's registration ("nanny failed", in a Slurm test run) or left a
    running engine without its control channel. Here the signal goes to every engine and every
    nanny of a fresh cluster, before any cell and again after one; all live on, and the next
    cell runs."""
    import psutil

    from nbdist.kernel.local import engine_nannies

    shell.run_line_magic("distrain", "restart -n 2")
    profile = magics.cluster._reaper.record.profile
    for _ in range(2):
        # The engines are usable once registered; each starts its nanny just after.
        wait_until(lambda: len(engine_nannies(profile)) == 2, 10)
        procs = [psutil.Process(e.pid) for e in magics.cluster.engines]
        procs += engine_nannies(profile)
        for proc in procs:
            proc.send_signal(signal.SIGUSR1)
        time.sleep(1.5)
        # A nanny that died stays a zombie until its engine reaps it: not alive either.
        dead = [p.pid for p in procs if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE]
        assert dead == [], (dead, [p.pid for p in procs[:2]], "engines first, then nannies")
        shell.run_cell_magic("distrain", "--no-plot -o r", "rank")
        assert shell.user_ns["r"].values == [0, 1]
