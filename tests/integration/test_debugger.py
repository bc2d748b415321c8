"""``%distrain debug``: pdb on the frames of the rank that failed, typed into the notebook's
own input box; ``%distrain where``: every rank's last stack after a Stop.

The cells are written as users write them: their own model class, a training function, a
config object. The first test runs a real Jupyter kernel and answers its input requests the
way the notebook's input box does (``input_reply`` on the stdin channel).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import pytest
from IPython.core.error import UsageError

from nbdist import JobInterrupted, JobStalled, WorkerError
from tests.cells import cell_in
from tests.procs import once, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

TRAIN = """
from dataclasses import dataclass

@dataclass
class Config:
    width: int = 4
    fail_at: int = 3

class Net(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.lin = nn.Linear(cfg.width, 1)

    def forward(self, x):
        return self.lin(x)

def train(cfg, steps):
    net = Net(cfg)
    for step in range(steps):
        loss = net(torch.ones(2, cfg.width)).sum()
        if rank == 1 and step == cfg.fail_at:
            raise ValueError(f"bad batch at step {step}")
    return loss

kept = 40 + rank
train(Config(), 5)
"""


def _line(source: str, text: str) -> int:
    """The editor's line number of the first line of ``source`` holding ``text``, in a cell
    whose first line is the ``%%distrain`` line."""
    return 2 + next(i for i, line in enumerate(source.splitlines()) if text in line)


RAISES, CALLS = _line(TRAIN, "raise ValueError"), _line(TRAIN, "train(Config(), 5)")


class Kernel:
    """A real Jupyter kernel; :meth:`run` answers its input requests (the notebook's input
    box) from a list, as a person types them, and returns the cell's output, the prompts
    shown and the reply."""

    def __init__(self, folder) -> None:
        from jupyter_client.manager import KernelManager

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
        self.km = KernelManager(kernel_name="python3")
        self.km.kernel_spec.argv[0] = sys.executable
        self.km.start_kernel(env=env, cwd=str(folder))
        self.client = self.km.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def run(self, code: str, answers: list | None = None) -> tuple[str, list[str], dict]:
        out: list[str] = []
        prompts: list[str] = []
        todo = list(answers or [])

        def output(msg: dict) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(content["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(content["traceback"]))

        def stdin(msg: dict) -> None:
            prompts.append(msg["content"]["prompt"])
            answer = todo.pop(0) if todo else "c"
            if isinstance(answer, tuple):  # (seconds to think, the line typed)
                time.sleep(answer[0])
                answer = answer[1]
            self.client.input(answer)

        reply = self.client.execute_interactive(
            code, timeout=240, allow_stdin=True, output_hook=output, stdin_hook=stdin
        )
        assert not todo, f"input left unasked: {todo}; output: {''.join(out)}"
        return "".join(out), prompts, reply["content"]

    def close(self) -> None:
        self.client.stop_channels()
        self.km.shutdown_kernel(now=False)


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(tmp_path)
    yield k
    k.close()


def test_post_mortem_in_a_real_kernel_typed_into_the_input_box(kernel):
    run = kernel.run
    assert run("%load_ext nbdist")[2]["status"] == "ok"
    out, _, reply = run("%%distrain -n 2 --no-plot\n" + TRAIN)
    assert reply["status"] == "error"
    assert "rank 1 (host " in out and "raised ValueError: bad batch at step 3" in out
    assert "To look at rank 1's variables where it raised: %distrain debug" in out
    answers = [
        "p step",
        "p cfg",
        "p type(net).__name__, rank",
        "up",
        "p kept",
        "interact",
        "total = sum(p.numel() for p in Net(Config(width=9)).parameters())",
        "print('params', total)",
        "exit()",
        "w",
        "q",
    ]
    out, prompts, reply = run("%distrain debug", answers)
    assert reply["status"] == "ok", out
    pdb, console = "(rank 1) Pdb ", "(rank 1) >>> "
    assert prompts == [pdb] * 6 + [console] * 3 + [pdb] * 2
    cell = "Cell In[2]"
    lines = out.splitlines()
    assert lines[:3] == [
        f"{cell}: ValueError: bad batch at step 3",
        f"> {cell}({RAISES})train()",
        '-> raise ValueError(f"bad batch at step {step}")',
    ], out
    assert lines[3:9] == [
        "3",
        "Config(width=4, fail_at=3)",
        "('Net', 1)",
        f"> {cell}({CALLS})<module>()",
        "-> train(Config(), 5)",
        "41",
    ], out
    assert "*interactive* (exit() goes back to pdb)" in lines
    assert "params 10" in lines
    assert lines[-4:] == [  # `w`, after `up`: the cell's frame (the current one), then train's
        f"> {cell}({CALLS})<module>()",
        "-> train(Config(), 5)",
        f"  {cell}({RAISES})train()",
        '-> raise ValueError(f"bad batch at step {step}")',
    ], out
    # The session goes on: every rank's variables, the group, the next cell.
    out, _, reply = run("%%distrain --no-plot -o after\nkept")
    assert reply["status"] == "ok", out
    out, _, _ = run("print(after.values)")
    assert out.strip() == "[40, 41]"
    # No cell failed since: nothing to look at, said so.
    out, _, reply = run("%distrain debug")
    assert reply["status"] == "error"
    assert "the last %%distrain cell did not fail" in out


# A model class of the cell's own, as users write them.
NET = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x)
"""

BREAK = NET + """
model = nn.parallel.DistributedDataParallel(Net())
t = torch.ones(1)
for step in range(3):
    if rank == 1 and step == 1:
        breakpoint()
    t = t * 2
    dist.all_reduce(t)
    model(torch.ones(2, 4)).sum().backward()
total = t.item()
"""


def test_breakpoint_pauses_the_rank_and_prompts_in_the_notebook(kernel):
    """Rank 1 stops at its breakpoint and the notebook prompts for it; rank 0 waits in the
    all-reduce meanwhile. pdb's `n` steps (a new stop, a new prompt), `c` lets the rank go on,
    and the cell ends as if nothing had paused it: the all-reduces are right on every rank,
    and no stall was seen although a rank sat at the prompt past --stall."""
    run = kernel.run
    assert run("%load_ext nbdist")[2]["status"] == "ok"
    answers = [
        (3.0, "p step, rank"),  # a person reads the prompt for longer than --stall
        "p t",
        "n",
        "p 'stepped'",
        "interact",
        "print(world_size)",
        "exit()",
        "c",
    ]
    out, prompts, reply = run("%%distrain -n 2 --no-plot --stall 2\n" + BREAK, answers)
    assert reply["status"] == "ok", out
    pdb = "(rank 1) Pdb "
    assert prompts == [pdb] * 5 + ["(rank 1) >>> "] * 2 + [pdb], (prompts, out)
    stop = _line(BREAK, "t = t * 2")
    assert f"> Cell In[2]({stop})<module>()\n-> t = t * 2\n" in out, out
    assert "\n(1, 1)\n" in out and "\ntensor([4.])\n" in out, out
    assert f"> Cell In[2]({stop + 1})<module>()\n-> dist.all_reduce(t)\n" in out, out
    assert "\n'stepped'\n" in out and "\n2\n" in out, out
    assert "stall" not in out.lower(), out
    assert "the others waiting" not in out, out  # no straggler from the paused steps
    # 1 → 2 → 4 (the all-reduce sums two ranks' 2) → 8 → 16 → 32 → 64 on every rank.
    out, _, _ = run("%%distrain --no-plot -o after\ntotal")
    out, _, _ = run("print(after.values)")
    assert out.strip() == "[64.0, 64.0]"
    # Two ranks at a breakpoint: taken one after the other, each prompt naming its rank
    both = "%%distrain --no-plot\nmine = rank * 10\nbreakpoint()\nt = torch.ones(1)\n"
    both += "dist.all_reduce(t)\n"
    out, prompts, reply = run(both, ["p mine", "c", "p mine", "c"])
    assert reply["status"] == "ok", out
    # (in the order they reached it: the lowest first of those waiting when the notebook looks)
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3], (prompts, out)
    assert sorted({prompts[0], prompts[2]}) == ["(rank 0) Pdb ", "(rank 1) Pdb "], out
    assert "\n0\n" in out and "\n10\n" in out, out


def test_q_at_a_breakpoint_stops_the_cell_as_stop_does(kernel):
    run = kernel.run
    assert run("%load_ext nbdist")[2]["status"] == "ok"
    # The breakpoint comes after 1.5 s of steps: the notebook has seen both ranks step (a
    # Stop before that is an interrupt, as the Stop button's is).
    cell = """%%distrain -n 2 --no-plot
import time
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100):
    time.sleep(0.05)
    if rank == 0 and step == 30:
        breakpoint()
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
"""
    out, prompts, reply = run(cell, ["p step", "q"])
    assert prompts == ["(rank 0) Pdb "] * 2, (prompts, out)
    assert "nbdist: stopping the cell at the next step boundary (rank 0 goes on to it)" in out
    assert reply["status"] == "error" and reply["ename"] == "JobInterrupted", out
    assert "every rank stopped after step" in out, out
    assert "The workers' variables are kept" in out, out
    out, _, _ = run("same = %distrain compare model\nprint(same.identical)")
    assert out.strip() == "True", out


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_commands_given_with_c_and_the_rank_asked_for(ready, magics, capsys):
    with pytest.raises(WorkerError) as info:
        ready.run_cell_magic("distrain", "--no-plot", TRAIN)
    assert info.value.ranks == [1]
    cell = cell_in(ready)
    capsys.readouterr()
    ready.run_line_magic("distrain", "debug -c 'p step, loss.shape' -c 'p cfg.fail_at'")
    assert _lines(capsys) == [
        f"{cell}: ValueError: bad batch at step 3",
        f"> {cell}({RAISES})train()",
        '-> raise ValueError(f"bad batch at step {step}")',
        "(rank 1) Pdb p step, loss.shape",
        "(3, torch.Size([]))",
        "(rank 1) Pdb p cfg.fail_at",
        "3",
    ]
    # Again, from the frame that raised: each %distrain debug starts anew.
    ready.run_line_magic("distrain", "debug 1 -c 'p step'")
    assert _lines(capsys)[-1] == "3"
    # Rank 0 finished its cell: it holds nothing, and says so.
    with pytest.raises(UsageError, match=r"rank 0: this engine holds no failed cell's frames"):
        ready.run_line_magic("distrain", "debug 0")
    with pytest.raises(UsageError, match=r"rank 5 does not exist; ranks go from 0 to 1"):
        ready.run_line_magic("distrain", "debug 5")


def test_a_ddp_model_only_the_frames_held_is_let_go_before_the_group_is_rebuilt(
    ready, magics, capsys
):
    """Rank 1 raises inside its own function, whose DDP model is a local variable; rank 0
    waits in the next gradient all-reduce, and the group is rebuilt. A DDP model alive while
    its group is destroyed can deadlock, so rank 1's frames are let go, and the debugger
    says why."""
    cell = """
def train():
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    for step in range(20):
        model(torch.ones(2, 4)).sum().backward()
        if rank == 1 and step == 2:
            raise RuntimeError("diverged")
train()
"""
    with pytest.raises(WorkerError) as info:
        ready.run_cell_magic("distrain", "--no-plot", cell)
    assert info.value.ranks == [1]
    assert "The process group was rebuilt" in info.value.state
    with pytest.raises(UsageError) as said:
        ready.run_line_magic("distrain", "debug")
    assert str(said.value) == (
        "%distrain debug: rank 1: its frames held a DistributedDataParallel model when the "
        "process group was rebuilt after the failure, and were let go then (a DDP model alive "
        "while its group is destroyed can deadlock)."
    )
    # The rebuilt group works.
    ready.run_cell_magic(
        "distrain", "--no-plot -o r", "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert ready.user_ns["r"].values == [2.0, 2.0]


def test_the_engine_that_failed_is_gone(ready, magics, capsys):
    with pytest.raises(WorkerError):
        ready.run_cell_magic("distrain", "--no-plot", TRAIN)
    cell = cell_in(ready)
    pid = magics.cluster.engines[1].pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: magics.cluster.dead([1]) == [1], 20)
    with pytest.raises(UsageError) as said:
        ready.run_line_magic("distrain", "debug")
    assert str(said.value) == (
        f"%distrain debug: the engine that ran rank 1 in {cell} (pid {pid}) died, and its "
        "frames went with it."
    )
    # The next cell heals the session: a new engine for rank 1, with rank 0's variables.
    ready.run_cell_magic("distrain", "--no-plot -o r", "kept")
    assert ready.user_ns["r"].values == [40, 40]


def test_where_after_a_stop_and_a_breakpoint_without_an_input_box(ready, magics, capsys):
    build = NET + """
model = nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def train_step():
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    time.sleep(0.05)
    opt.step()
"""
    ready.run_cell_magic("distrain", "--no-plot", build)
    train = "import time\nfor step in range(10**6):\n    train_step()\n"
    before = magics.session.view

    def stepping() -> bool:
        view = magics.session.view
        return view is not None and view is not before and view.agg.seen >= 2

    sender = once(stepping, lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(JobInterrupted) as info:
        ready.run_cell_magic("distrain", "--no-plot", train)
    sender.join()
    cell, build_cell = cell_in(ready), f"Cell In[{ready.execution_count}]"
    taken = str(info.value).split(" steps taken")[0].split("(")[-1]
    capsys.readouterr()
    ready.run_line_magic("distrain", "where")
    lines = _lines(capsys)
    for rank in (0, 1):
        at = lines.index(f"rank {rank}: stopped at a step boundary ({taken} steps taken)")
        assert lines[at + 1 : at + 4] == [
            f"  {cell}, line 4, in <module>: train_step()",
            f"  {build_cell}, line 18, in train_step: opt.step()",
            lines[at + 3],
        ]
        assert lines[at + 3].startswith("    torch/optim/optimizer.py:")
    with pytest.raises(UsageError, match="after a Stop, %distrain where shows where each rank"):
        ready.run_line_magic("distrain", "debug")
    # breakpoint() where the front end has no input box (this shell's stdin cannot be read):
    # said once for the cell, and every rank goes on past its breakpoints.
    ready.run_cell_magic(
        "distrain", "--no-plot", "for i in range(3):\n    breakpoint()\ndone = i\n"
    )
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "no input box" in line]
    assert len(said) == 1, out
    assert said[0].endswith(
        "stopped at a breakpoint, and this front end has no input box for the debugger's "
        "prompt: the ranks go on past their breakpoints in this cell (c). Run the notebook in "
        "JupyterLab, Notebook 7 or VS Code to type pdb commands there."
    ), out
    ready.run_cell_magic("distrain", "--no-plot -o r", "done")
    assert ready.user_ns["r"].values == [2, 2]
    # A cell that ended normally leaves no stack.
    ready.run_line_magic("distrain", "where")
    assert _lines(capsys) == [
        "nbdist: where: the last cell ended normally on every rank (no stack to show)."
    ]


def _rank_1_sleeps(*, steps: int, at: int, seconds: int) -> str:
    """A cell whose rank 1 sleeps before the all-reduce of step ``at`` (its line 7), while
    rank 0 waits in it (line 8)."""
    return f"""
import time
t = torch.ones(1)
for step in range({steps}):
    if rank == 1 and step == {at}:
        time.sleep({seconds})
    dist.all_reduce(t)
    log(loss=1.0)
"""


def test_the_live_panel_says_where_a_rank_waits(ready, magics):
    """Rank 1 sleeps before its all-reduce; rank 0 waits in it. Before any --stall, the
    panel's row for each says where it is."""
    cell = _rank_1_sleeps(steps=3, at=1, seconds=6)
    tables: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            view = magics.session.view
            if view is not None and view.dashboard is not None:
                tables.append(view.dashboard.table.value)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        ready.run_cell_magic("distrain", "", cell)
    finally:
        stop.set()
        watcher.join()
    rows = [t.split("</th></tr>")[1] for t in tables]
    said = [r for r in rows if "<small>" in r]
    assert said, "\n".join(rows)
    assert said[-1].startswith(
        "<tr><td>0</td><td>running<br><small>waits in torch.distributed.all_reduce, "
        "line 8: dist.all_reduce(t)</small></td>"
    ), said[-1]
    assert "<tr><td>1</td><td>running<br><small>at line 7: time.sleep(6)</small></td>" in said[-1]
    assert "<small>" not in rows[0]  # said only once a rank has not stepped for a while


def test_a_stall_says_what_the_flight_recorder_saw(ready, magics):
    """torch records gloo's collectives too (torch >= 2.7): the stall's report numbers each
    rank's last one, and says which rank is behind, by how many."""
    cell = _rank_1_sleeps(steps=20, at=5, seconds=3600)
    with pytest.raises(JobStalled) as info:
        ready.run_cell_magic("distrain", "--no-plot --stall 3", cell)
    flight = info.value.flight
    said = re.fullmatch(
        r"torch's flight recorder, each rank's last collective: rank 0 #(\d+) gloo:all_reduce, "
        r"rank 1 #(\d+) gloo:all_reduce \(rank 1 is 1 collective behind\)\.",
        flight,
    )
    assert said and int(said.group(1)) == int(said.group(2)) + 1, flight
    rendered = info.value._render_traceback_()
    assert rendered[1] == flight and rendered[0].startswith("JobStalled: no progress for 3 s")
    assert flight not in str(info.value)  # the message itself is as before
