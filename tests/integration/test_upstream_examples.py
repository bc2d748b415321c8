"""Upstream code in cells, as a user pastes it: pytorch/examples' DDP tutorial series
(``distributed/ddp-tutorial-series/multigpu_torchrun.py``: its ``Trainer`` class, its
``MyTrainDataset``, ``load_train_objs``, ``prepare_dataloader``), run from the upstream source
itself, which this repository keeps no copy of.

The source is read from a checkout of https://github.com/pytorch/examples: the folder (or git
directory) named by ``NBDIST_PYTORCH_EXAMPLES``, else a mirror beside this checkout
(``../.mirror/pytorch+examples/repo``, where this project's tool library puts it). Without one
the tests skip and say how to give one.

On CPU workers the script needs what nbdist's checker tells a user to change: ``.to(gpu_id)``
becomes ``.to(device)``, and DDP gets no ``device_ids``. Each change is checked to apply, so a
new upstream version fails here loudly instead of being run half-changed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import time
from pathlib import Path

import pytest

from nbdist import WorkerDied
from tests.procs import cell_started, kill_now, once_written

pytestmark = [pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

SERIES = "distributed/ddp-tutorial-series"
ENV = "NBDIST_PYTORCH_EXAMPLES"
MIRROR = Path(__file__).resolve().parents[3] / ".mirror" / "pytorch+examples" / "repo"

# What a user changes for CPU workers (nbdist's checker names each), and how often it occurs.
CPU_CHANGES = (
    ("self.model = model.to(self.gpu_id)", "self.model = model.to(device)", 1),
    ("source = source.to(self.gpu_id)", "source = source.to(device)", 1),
    ("targets = targets.to(self.gpu_id)", "targets = targets.to(device)", 1),
    ("DDP(self.model, device_ids=[self.gpu_id])", "DDP(self.model)", 1),
)
PASTED = ("Trainer", "load_train_objs", "prepare_dataloader")


def _read(name: str) -> str:
    where = os.environ.get(ENV)
    root = Path(where) if where else MIRROR
    if (root / SERIES / name).is_file():
        return (root / SERIES / name).read_text()
    if (root / "HEAD").is_file():  # a git directory without a work tree
        shown = subprocess.run(
            ["git", f"--git-dir={root}", "show", f"HEAD:{SERIES}/{name}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if shown.returncode == 0:
            return shown.stdout
    pytest.skip(
        f"pytorch/examples not found (looked in {root}): set {ENV} to a checkout of "
        "https://github.com/pytorch/examples to run its DDP tutorial in cells"
    )


def _definitions(source: str, names: tuple[str, ...]) -> str:
    """The top-level imports of ``source`` (but its local ``datautils``) and the definitions
    named, as they stand in it."""
    tree = ast.parse(source)
    parts = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if getattr(node, "module", None) != "datautils":
                parts.append(ast.get_source_segment(source, node))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            parts.append(ast.get_source_segment(source, node))
    found = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert set(names) <= set(found), f"upstream has changed: {found}"
    return "\n\n".join(parts) + "\n"


@pytest.fixture(scope="module")
def pasted() -> str:
    """The cell a user pastes: the dataset class, then the script's imports and definitions."""
    script = _definitions(_read("multigpu_torchrun.py"), PASTED)
    for old, new, count in CPU_CHANGES:
        assert script.count(old) == count, f"upstream has changed: {old!r}"
        script = script.replace(old, new)
    return _definitions(_read("datautils.py"), ("MyTrainDataset",)) + "\n" + script


def _start(sh, pasted: str, snapshot: Path) -> None:
    """The pasted definitions, then ``main``'s body without its process-group calls (nbdist
    has the group), with the snapshot in the test's folder."""
    sh.run_cell_magic("distrain", "--no-plot", pasted)
    sh.run_cell_magic(
        "distrain", "--no-plot",
        "torch.manual_seed(0)\n"
        "dataset, model, optimizer = load_train_objs()\n"
        "train_data = prepare_dataloader(dataset, 32)\n"
        f"trainer = Trainer(model, train_data, optimizer, 10, {str(snapshot)!r})\n",
    )  # fmt: skip


# One step of trainer.model on each rank's own data: the replicas stay equal only if DDP
# averages the gradients, i.e. if trainer.model is a DDP on a working group.
STEP = """
g = torch.Generator().manual_seed(100 + rank)
x, y = torch.randn(16, 20, generator=g), torch.randn(16, 1, generator=g)
trainer.optimizer.zero_grad()
nn.functional.mse_loss(trainer.model(x), y).backward()
trainer.optimizer.step()
type(trainer.model).__name__
"""


SHARDS = "s = train_data.sampler\n(s.rank, s.num_replicas, trainer.gpu_id)\n"
# What the healing's last line asks for: the values a cell computed from the rank, set again.
RESET_GPU_ID = 'trainer.gpu_id = int(os.environ["LOCAL_RANK"])\n'


def _epochs(said: str) -> list[str]:
    return sorted(line for line in said.splitlines() if "| Batchsize: " in line)


def test_the_ddp_tutorials_trainer_survives_kills_and_crosses_to_the_notebook(
    fresh_session, magics, capsys, tmp_path, pasted
):
    sh = fresh_session
    _start(sh, pasted, tmp_path / "snapshot.pt")
    capsys.readouterr()
    sh.run_cell_magic("distrain", "--no-plot", "trainer.train(2)\n")
    said = capsys.readouterr().out
    assert _epochs(said) == [
        f"[rank {r}] [GPU{r}] Epoch {e} | Batchsize: 32 | Steps: 32" for r in (0, 1) for e in (0, 1)
    ], said
    assert (tmp_path / "snapshot.pt").is_file()  # rank 0 saved one at epoch 0, as upstream does

    # Rank 1 killed mid-train(): the session heals, trainer.model is wrapped again.
    folder = tmp_path / "mid"
    folder.mkdir()
    first, running = cell_started(folder, 2)
    victim = magics.cluster.engines[1].pid

    def kill() -> None:
        time.sleep(0.5)  # well inside train(): its first epoch has begun
        kill_now(victim)

    killer = once_written(running, kill)
    try:
        with pytest.raises(WorkerDied) as info:
            sh.run_cell_magic("distrain", "--no-plot", first + "trainer.train(10**6)\n")
    finally:
        killer.join()
    assert str(info.value).splitlines()[-1].startswith(
        "The session was healed: a new engine took rank 1, and every rank got rank 0's "
        "variables (DDP, DataLoader, Dataset, DistributedSampler, MyTrainDataset, Trainer, "
        "dataset, destroy_process_group, init_process_group, load_train_objs, model, optimizer, "
        "prepare_dataloader, train_data, trainer) and imports (F, mp, os); the next cell wraps "
        "trainer.model in DistributedDataParallel again, on a new process group; "
        "train_data.sampler (DistributedSampler) reads each rank's own shard again. Values the "
        "cells computed from the rank (a gpu_id = LOCAL_RANK, a shard of your own) are rank 0's "
        "on every rank now: set them again."
    ), str(info.value)
    assert sh.run_cell_magic("distrain", "--no-plot", STEP) == "DistributedDataParallel"
    same = sh.run_line_magic("distrain", "compare model")  # trainer.model's module
    assert same.identical, same
    # Each rank reads its own shard again; the Trainer's gpu_id is rank 0's, as the line says.
    assert list(sh.run_cell_magic("distrain", "", SHARDS)) == [(0, 2, 0), (1, 2, 0)]

    # Rank 1 killed between cells: healed before the next cell, which trains on.
    kill_now(magics.cluster.engines[1].pid)
    capsys.readouterr()
    sh.run_cell_magic("distrain", "--no-plot", RESET_GPU_ID + "trainer.train(1)\n")
    said = capsys.readouterr().out
    assert "nbdist: the session was healed: a new engine took rank 1" in said, said
    assert _epochs(said) == [
        f"[rank {r}] [GPU{r}] Epoch 0 | Batchsize: 32 | Steps: 32" for r in (0, 1)
    ], said
    assert sh.run_cell_magic("distrain", "--no-plot", STEP) == "DistributedDataParallel"
    assert sh.run_line_magic("distrain", "compare model").identical

    # The trainer to the notebook: its DDP model arrives as the module it wraps.
    sh.run_line_magic("distrain", "pull trainer")
    trainer = sh.user_ns["trainer"]
    assert type(trainer).__name__ == "Trainer"
    assert type(trainer.model).__name__ == "Linear" and trainer.model.in_features == 20
    assert trainer.optimizer.param_groups[0]["params"][0] is trainer.model.weight

    # A config dataclass from the notebook, pushed, drives the next run.
    sh.run_cell(
        "from dataclasses import dataclass\n\n@dataclass\nclass Run:\n    epochs: int = 1\n\n"
        "run = Run(epochs=1)\n"
    )
    capsys.readouterr()
    sh.run_cell_magic("distrain", "--no-plot --push run", "trainer.train(run.epochs)\n")
    assert len(_epochs(capsys.readouterr().out)) == 2
