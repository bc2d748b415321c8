"""Notebooks as people write them: their own classes, functions, lambdas, dataclasses and
imports cross between the notebook and the workers, and survive a healing. Real engines, real
gloo, real SIGKILL; the cells are written as a user writes them, not with nbdist's names only."""

from __future__ import annotations

import sys
import time

import pytest
from IPython.core.error import UsageError

from nbdist import WorkerError
from tests.procs import kill_now

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

# A plain notebook cell: a config dataclass, a function, a lambda.
NOTEBOOK = """
from dataclasses import dataclass, field

@dataclass
class Cfg:
    hidden: int = 16
    lr: float = 0.05
    tags: list = field(default_factory=lambda: ["ddp"])

cfg = Cfg(hidden=8)

def scale(x, by=2):
    return by * x

shift = lambda x: x + 1
"""

# A %%distrain cell as a user writes it: imports, their own model class, a train function.
MODEL = """
import time
import math
import numpy as np
import xml.etree.ElementTree
from math import sqrt
from torch.utils.data import TensorDataset, DataLoader

class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x)

torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(Net(cfg.hidden))
opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
g = torch.Generator().manual_seed(rank)
data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
squash = lambda v: math.tanh(v)
steps = 0

def train(epochs):
    global steps
    for _ in range(epochs):
        for x, y in DataLoader(data, batch_size=16):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            steps += 1
    time.sleep(0.01)
    return round(loss.item(), 6)
"""

# Every name the session made, used on every rank; the functions see the session's own globals.
USES = """
train(1)
(
    steps,
    type(model).__name__,
    type(model.module).__name__,
    isinstance(model.module, Net),
    train.__globals__ is globals() and Net.forward.__globals__ is globals(),
    scale(cfg.hidden), shift(1), round(squash(0.5), 4), sqrt(4.0), float(np.float32(1.5)),
    xml.etree.ElementTree.fromstring("<a/>").tag, time.time() > 0,
)
"""


def _notebook(sh) -> None:
    sh.run_cell(NOTEBOOK)


def test_a_notebook_dataclass_function_and_lambda_are_pushed(fresh_session, magics, capsys):
    sh = fresh_session
    _notebook(sh)
    cell = "(type(cfg).__name__, cfg, scale(cfg.lr), shift(rank))"
    got = sh.run_cell_magic("distrain", "--push cfg,scale,shift", cell)
    # The Cfg that comes back is the notebook's own class (cloudpickle keeps one class per
    # class sent by value): the values compare equal.
    cfg = sh.user_ns["Cfg"](hidden=8)
    assert list(got) == [("Cfg", cfg, 0.1, 1), ("Cfg", cfg, 0.1, 2)], got
    sh.user_ns["cfg"].tags.append("pushed")
    capsys.readouterr()
    sh.run_line_magic("distrain", "push cfg")
    assert capsys.readouterr().out == "nbdist: pushed cfg to every worker\n"
    assert list(sh.run_cell_magic("distrain", "", "cfg.tags + [rank]")) == [
        ["ddp", "pushed", 0],
        ["ddp", "pushed", 1],
    ]


def test_a_model_of_a_cells_own_class_comes_back_to_the_notebook(fresh_session, capsys):
    sh = fresh_session
    _notebook(sh)
    sh.run_cell_magic("distrain", "--no-plot --push cfg,scale,shift", MODEL + "train(1)\n")
    start = time.monotonic()
    capsys.readouterr()
    sh.run_line_magic("distrain", "pull model,train,squash")
    assert time.monotonic() - start < 10
    assert capsys.readouterr().out == (
        "nbdist: pulled model, train, squash from rank 0 (model is a DistributedDataParallel "
        "model on the workers: the notebook has no process group, so it got the module it "
        "wraps)\n"
    )
    model = sh.user_ns["model"]
    assert type(model).__name__ == "Net" and model.body[0].out_features == 8
    assert sh.user_ns["squash"](0.0) == 0.0
    # The cell's value: an object of the cell's class, and --pull of one.
    value = sh.run_cell_magic("distrain", "--pull net", "net = model.module\nnet")
    assert type(value).__name__ == "Net" and type(sh.user_ns["net"]).__name__ == "Net"


def test_what_cannot_cross_is_named_in_one_line_and_nothing_hangs(
    fresh_session, magics, tmp_path, monkeypatch
):
    """A class from a module only one side can import: named, with why, in seconds."""
    sh = fresh_session
    only_here = tmp_path / "notebook_only"
    only_here.mkdir()
    (only_here / "kernelmod.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(only_here))
    monkeypatch.delitem(sys.modules, "kernelmod", raising=False)
    sh.run_cell("import kernelmod\nthing = kernelmod.Thing()\n")
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        sh.run_cell_magic("distrain", "--push thing", "thing\n")
    assert time.monotonic() - start < 10
    host = magics.cluster.engines[0].host
    assert str(info.value).startswith(
        f"ranks 0, 1 (host {host}) raised UnpackError: --push thing could not be rebuilt on this "
        "worker (ModuleNotFoundError: No module named 'kernelmod')"
    ), str(info.value)
    # ... and the other way: a module only the workers import.
    workers_only = tmp_path / "workers_only"
    workers_only.mkdir()
    (workers_only / "enginemod.py").write_text("class Thing:\n    pass\n")
    sh.run_cell_magic(
        "distrain", "", f"import sys\nsys.path.insert(0, {str(workers_only)!r})\n"
        "import enginemod\nthing = enginemod.Thing()\n"
    )  # fmt: skip
    start = time.monotonic()
    with pytest.raises(UsageError) as usage:
        sh.run_line_magic("distrain", "pull thing")
    assert time.monotonic() - start < 10
    assert str(usage.value) == (
        "%distrain pull: rank 0: thing could not be rebuilt in the notebook "
        "(ModuleNotFoundError: No module named 'enginemod')"
    )


def test_a_healing_carries_the_sessions_imports_functions_and_classes(
    fresh_session, magics, capsys
):
    sh = fresh_session
    _notebook(sh)
    sh.run_cell_magic("distrain", "--no-plot --push cfg,scale,shift", MODEL + "train(2)\n")
    kill_now(magics.cluster.engines[1].pid)
    capsys.readouterr()
    got = sh.run_cell_magic("distrain", "--no-plot", USES)
    said = capsys.readouterr().out
    assert (
        "nbdist: the session was healed: a new engine took rank 1, and every rank got rank 0's "
        "variables (DataLoader, Net, TensorDataset, cfg, data, g, model, opt, scale, shift, "
        "sqrt, squash, steps, train) and imports (math, np, time, xml); the next cell wraps "
        "model in DistributedDataParallel again, on a new process group. Values the cells "
        "computed from the rank (a gpu_id = LOCAL_RANK, a shard of your own) are rank 0's on "
        "every rank now: set them again." in said
    ), said
    # Every rank alike: 2 epochs of 4 batches before, 1 after; functions bound to the session.
    expected = (12, "DistributedDataParallel", "Net", True, True, 16, 2, 0.4621, 2.0, 1.5, "a",
                True)  # fmt: skip
    assert got == expected, got
    assert sh.run_line_magic("distrain", "compare model").identical
