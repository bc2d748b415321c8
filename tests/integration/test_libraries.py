"""The training libraries people bring, run unchanged in ``%%distrain`` cells on two CPU workers:
Hugging Face ``Trainer``, accelerate's ``Accelerator()``, Lightning's ``Fabric`` and ``Trainer``.
Each must train one model across the ranks (the replicas identical afterwards, each rank a share
of the data), and a cell whose ranks train alone ends with one warning."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from nbdist import WorkerError

pytestmark = [pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

pytest.importorskip("transformers")
pytest.importorskip("lightning")

# Each rank trains on data of its own (seeded by rank): only a synchronised model comes out the
# same on both.
HF_TRAINER = """
import tempfile
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

torch.manual_seed(0)
config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=37, max_position_embeddings=32, num_labels=2)
bert = BertForSequenceClassification(config)
g = torch.Generator().manual_seed(0)
ids, labels = torch.randint(0, 100, (64, 16), generator=g), torch.randint(0, 2, (64,), generator=g)
seen = []

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        seen.append(i)
        return {"input_ids": ids[i], "labels": labels[i]}

args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8,
                         num_train_epochs=1, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True)
trainer = Trainer(model=bert, args=args, train_dataset=Data())
trainer.train()
(trainer.args.world_size, str(trainer.args.parallel_mode), sorted(seen))
"""

ACCELERATE = """
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
acc_model = nn.Linear(8, 1)
acc_opt = torch.optim.SGD(acc_model.parameters(), lr=0.1)
acc_model, acc_opt = accelerator.prepare(acc_model, acc_opt)
x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
for _ in range(5):
    acc_opt.zero_grad()
    accelerator.backward(acc_model(x).pow(2).mean())
    acc_opt.step()
(str(accelerator.distributed_type), accelerator.num_processes)
"""

FABRIC = """
import lightning as L

fabric = L.Fabric({args})
fabric.launch()
torch.manual_seed(0)
{name} = nn.Linear(8, 1)
fab_opt = torch.optim.SGD({name}.parameters(), lr=0.1)
{name}, fab_opt = fabric.setup({name}, fab_opt)
x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
for _ in range(5):
    fab_opt.zero_grad()
    fabric.backward({name}(x).pow(2).mean())
    fab_opt.step()
(type(fabric.strategy).__name__, fabric.world_size, fabric.global_rank)
"""

LIGHTNING_TRAINER = """
import lightning as L

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, i):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
pl_model = Regression()
data = torch.utils.data.TensorDataset(torch.randn(64, 8))
trainer = L.Trainer({args}max_epochs=1, enable_progress_bar=False, logger=False,
                    enable_checkpointing=False, enable_model_summary=False)
trainer.fit(pl_model, torch.utils.data.DataLoader(data, batch_size=8))
(type(trainer.strategy).__name__, trainer.world_size, trainer.num_devices)
"""


def _children(magics) -> list[str]:
    """What the engines started besides ipyparallel's nanny (one per engine)."""
    commands = [
        " ".join(c.cmdline())
        for e in magics.cluster.engines
        for c in psutil.Process(e.pid).children()
    ]
    return [c for c in commands if "ipyparallel.engine.nanny" not in c]


def _run(sh, cell):
    sh.run_cell_magic("distrain", "--no-plot -o res", cell)
    return sh.user_ns["res"]


def _identical(sh, name):
    same = sh.run_line_magic("distrain", f"compare {name}")
    assert same.identical, same
    return same


def test_hugging_face_trainer_trains_one_model_on_a_share_of_the_data_each(fresh_session):
    res = _run(fresh_session, HF_TRAINER)
    (world, mode, seen0), (_, _, seen1) = res.values
    assert (world, mode) == (2, "ParallelMode.DISTRIBUTED")
    assert len(seen0) == len(seen1) == 32 and sorted(seen0 + seen1) == list(range(64))
    _identical(fresh_session, "bert")
    assert res.warnings == ()


def test_accelerator_without_arguments_is_multi_cpu(fresh_session):
    res = _run(fresh_session, ACCELERATE)
    assert res.values == [("DistributedType.MULTI_CPU", 2)] * 2
    assert _identical(fresh_session, "acc_model").entries == 2
    assert res.warnings == ()


@pytest.mark.parametrize(
    "args", ['accelerator="cpu", devices=world_size, strategy="ddp"', ""], ids=["ddp", "defaults"]
)
def test_lightning_fabric_joins_the_group(fresh_session, magics, args):
    res = _run(fresh_session, FABRIC.format(args=args, name="fab_model"))
    assert res.values == [("DDPStrategy", 2, 0), ("DDPStrategy", 2, 1)]
    _identical(fresh_session, "fab_model")
    assert _children(magics) == []  # no process spawned: it joined nbdist's


@pytest.mark.parametrize("args", ['strategy="ddp", ', ""], ids=["ddp", "defaults"])
def test_lightning_trainer_joins_the_group(fresh_session, magics, args):
    res = _run(fresh_session, LIGHTNING_TRAINER.format(args=args))
    assert res.values == [("DDPStrategy", 2, 2)] * 2
    _identical(fresh_session, "pl_model")
    assert _children(magics) == []


def test_ranks_that_train_alone_are_warned_about_once(fresh_session, capsys):
    alone = """
from accelerate import Accelerator

accelerator = Accelerator()   # created, but the model is never prepared
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
for _ in range(3):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
"""
    res = _run(fresh_session, alone)
    import accelerate

    warning = (
        "nbdist: warning: the ranks trained independent copies: they ran training steps (rank 0 "
        "3, rank 1 3), and no collective (a gradient all-reduce, a broadcast) ran on any rank "
        f"during this cell, so nothing kept their models the same. The cell uses accelerate "
        f"{accelerate.__version__} (Accelerator): a library that did not see the process group "
        "trains alone on each rank (the README's Libraries section says what nbdist sets up for "
        "each, and which versions were tested). Wrap a torch model in DistributedDataParallel "
        "(or fully_shard), build a Keras model in strategy.scope(); %distrain compare NAME "
        "shows whether the replicas agree."
    )
    assert res.warnings == (warning,)
    assert capsys.readouterr().err.count("nbdist: warning:") == 1
    assert not fresh_session.run_line_magic("distrain", "compare model").identical
    # The same loop on a DDP model: no warning.
    ddp = alone.replace(
        "model = nn.Linear(8, 1)", "model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))"
    )
    assert _run(fresh_session, ddp).warnings == ()


@pytest.mark.parametrize(
    ("cell", "call"),
    [
        (
            "import lightning as L\nfabric = L.Fabric(accelerator='cpu', devices=2, "
            "strategy='ddp_notebook')\nfabric.launch(lambda f: None)\n",
            "start_processes",
        ),
        (
            "import torch.multiprocessing as mp\n\ndef work(i):\n    pass\n\n"
            "mp.spawn(work, nprocs=2)\n",
            "spawn",
        ),
    ],
    ids=["lightning-ddp_notebook", "mp.spawn"],
)
def test_starting_worker_processes_from_a_cell_fails_at_once(fresh_session, cell, call):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        fresh_session.run_cell_magic("distrain", "--no-check", cell)
    assert time.monotonic() - start < 15
    assert str(info.value).splitlines()[0] == (
        f"ranks 0, 1 (host {os.uname().nodename}) raised RuntimeError: "
        f"torch.multiprocessing.{call}() starts worker processes from a %%distrain cell, and "
        "this worker already is one of its 2 ranks: the processes it would start cannot join the "
        "group. Call the worker function directly, fn(rank, world_size); with "
        "Lightning use strategy='ddp' (not ddp_notebook, ddp_spawn or ddp_fork), with "
        "accelerate Accelerator() (not notebook_launcher)."
    )
