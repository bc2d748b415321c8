"""Each checker rule with a cell that triggers it and the corrected cell that does not."""

import textwrap
from pathlib import Path

import nbformat
import pytest

from nbdist.kernel.checks import CheckContext, check_source

CPU = CheckContext(world_size=2, gpus=0)
GPUS = CheckContext(world_size=2, gpus=2)


def rules(source, ctx=CPU):
    return [(f.rule, f.line) for f in check_source(textwrap.dedent(source), ctx)]


CASES = [
    (
        "dataparallel-in-ddp",
        """
        model = nn.Sequential(nn.Linear(10, 10))
        model = nn.DataParallel(model)
        model = nn.parallel.DistributedDataParallel(model)
        """,
        """
        model = nn.Sequential(nn.Linear(10, 10))
        model = nn.parallel.DistributedDataParallel(model)
        """,
        3,
    ),
    (
        "loader-without-sampler",
        """
        loader = DataLoader(data, batch_size=32)
        model = DDP(net)
        """,
        """
        loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))
        model = DDP(net)
        """,
        2,
    ),
    (
        "shuffle-with-sampler",
        """
        loader = DataLoader(data, shuffle=True, sampler=DistributedSampler(data))
        model = DDP(net)
        """,
        """
        loader = DataLoader(data, sampler=DistributedSampler(data))
        model = DDP(net)
        """,
        2,
    ),
    (
        "missing-set-epoch",
        """
        sampler = DistributedSampler(data)
        for epoch in range(3):
            train(sampler)
        """,
        """
        sampler = DistributedSampler(data)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            train(sampler)
        """,
        3,
    ),
    (
        "nccl-without-gpu",
        "dist.init_process_group('nccl')\n",
        "dist.init_process_group('gloo')\n",
        1,
    ),
    (
        "second-init",
        "dist.init_process_group(backend='gloo')\nx = 1\ndist.init_process_group(backend='gloo')\n",
        "dist.init_process_group(backend='gloo')\n",
        3,
    ),
    (
        "unguarded-save",
        "torch.save(model.state_dict(), 'ckpt.pt')\n",
        "if is_main:\n    torch.save(model.state_dict(), 'ckpt.pt')\n",
        1,
    ),
    (
        "unguarded-print",
        "for step in range(10):\n    print(f'loss {loss.item()}')\n",
        "for step in range(10):\n    if rank == 0:\n        print(f'loss {loss.item()}')\n",
        2,
    ),
    (
        "keras-outside-scope",
        """
        model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
        with strategy.scope():
            model.compile(optimizer='sgd', loss='mse')
        """,
        """
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
            model.compile(optimizer='sgd', loss='mse')
        """,
        2,
    ),
    (
        "tfconfig-connect",
        """
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        resolver.connect()
        """,
        """
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
        """,
        3,
    ),
    (
        "strategy-after-ops",
        """
        x = tf.constant([1.0])
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        """,
        """
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        x = tf.constant([1.0])
        """,
        3,
    ),
    (
        "per-worker-batch",
        """
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        ds = ds.batch(per_worker_batch)
        """,
        """
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        ds = ds.batch(per_worker_batch * strategy.num_replicas_in_sync)
        """,
        3,
    ),
]


# The rules about ranks that run different code, with the PyTorch DDP tutorial's own lines.
CASES += [
    (
        "spawn-in-cell",
        """
        import torch.multiprocessing as mp
        def demo_basic(rank, world_size):
            setup(rank, world_size)
        mp.spawn(demo_basic, args=(world_size,), nprocs=world_size, join=True)
        """,
        """
        def demo_basic(rank, world_size):
            setup(rank, world_size)
        demo_basic(rank, world_size)
        """,
        5,
    ),
    (
        "spawn-in-cell",
        """
        from torch.multiprocessing import start_processes
        start_processes(train, nprocs=2, start_method="fork")
        """,
        "train(rank, world_size)\n",
        3,
    ),
    (
        "spawn-in-cell",
        """
        import multiprocessing
        p = multiprocessing.Process(target=train, args=(0, 2))
        p.start()
        """,
        "train(rank, world_size)\n",
        3,
    ),
    (
        "rank-as-gpu-index",
        """
        model = ToyModel().to(rank)
        ddp_model = DDP(model, device_ids=[rank])
        """,
        """
        model = ToyModel().to(device)
        ddp_model = DDP(model)
        """,
        2,
    ),
    (
        "rank-as-gpu-index",
        'x = torch.ones(1, device=torch.device(f"cuda:{rank}"))\n',
        "x = torch.ones(1, device=device)\n",
        1,
    ),
    (
        "rank-as-gpu-index",
        "torch.cuda.set_device(dist.get_rank())\n",
        "torch.cuda.set_device(local_rank)\n",
        1,
    ),
    (
        "uneven-slices",
        """
        xs, ys = X[rank::world_size], Y[rank::world_size]
        for i in range(0, len(xs), 5):
            loss = loss_fn(model(xs[i : i + 5]), ys[i : i + 5])
            loss.backward()
        """,
        """
        xs, ys = X[rank::world_size], Y[rank::world_size]
        with Join([model]):
            for i in range(0, len(xs), 5):
                loss = loss_fn(model(xs[i : i + 5]), ys[i : i + 5])
                loss.backward()
        """,
        3,
    ),
    (
        "uneven-slices",
        """
        part = torch.chunk(data, world_size)[rank]
        loader = DataLoader(TensorDataset(part), batch_size=8)
        for (xb,) in loader:
            dist.all_reduce(xb.sum())
        """,
        """
        part = torch.chunk(data, world_size)[rank]
        loader = DataLoader(TensorDataset(part), batch_size=8)
        total = sum(xb.sum() for (xb,) in loader)
        dist.all_reduce(total)
        """,
        4,
    ),
]


def test_spawn_finding_names_the_function_to_call():
    (finding,) = check_source("mp.spawn(demo_basic, args=(2,), nprocs=2)\n", CPU)
    assert str(finding) == (
        "nbdist check [spawn-in-cell] line 1: mp.spawn(...) starts worker processes from a "
        "%%distrain cell: nbdist already runs one process per rank, and processes started from "
        "a worker cannot join its group (nbdist stops the cell with an error). Call "
        "demo_basic(rank, world_size) directly (see notebooks/08_when_ranks_disagree.ipynb, "
        "'One process per rank')."
    )


def test_distributed_checkpoint_save_on_every_rank_is_right():
    assert (
        rules("import torch.distributed.checkpoint as dcp\ndcp.save(state, checkpoint_id=d)\n")
        == []
    )
    assert rules("torch.save(state, path)\n") == [("unguarded-save", 1)]


def test_rank_as_gpu_index_names_what_it_saw():
    (finding,) = check_source("m = DDP(m, device_ids=[rank])\n", CPU)
    assert finding.message.startswith("device_ids=[rank] uses the global rank as a GPU index")
    # The local rank is each worker's own GPU, as under torchrun.
    assert rules("m = DDP(m, device_ids=[local_rank])\nx.to(local_rank)\n", GPUS) == []


# pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py: its shape.
TORCHRUN_TRAINER = """
import os
import torch
from torch.distributed import init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

def ddp_setup():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="gloo")

class Trainer:
    def __init__(self, model, data, optimizer, snapshot_path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model.to(self.gpu_id), device_ids=[self.gpu_id])
        self.data, self.optimizer, self.snapshot_path = data, optimizer, snapshot_path

    def _run_epoch(self, epoch):
        for source, targets in self.data:
            source = source.to(self.gpu_id)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % 10 == 0:
                self._save_snapshot(epoch)
"""


def test_a_torchrun_script_on_workers_without_gpus_is_told_to_use_device():
    findings = check_source(TORCHRUN_TRAINER, CPU)
    assert [(f.rule, f.line) for f in findings] == [
        ("cuda-without-gpu", 8),
        ("cuda-without-gpu", 14),
        ("cuda-without-gpu", 14),
        ("cuda-without-gpu", 19),
    ]
    assert findings[0].message.startswith(
        "torch.cuda.set_device(...) asks for a GPU, and these workers have none"
    )
    assert "model.to(device)" in findings[0].message
    assert sorted(f.message.split(" asks")[0] for f in findings[1:]) == [
        ".to(self.gpu_id)",
        ".to(self.gpu_id)",
        "device_ids=[self.gpu_id]",
    ]
    # On GPU workers the same script is right: the local rank is the worker's own GPU.
    assert check_source(TORCHRUN_TRAINER, GPUS) == []


def test_a_save_its_caller_guards_is_not_flagged():
    guarded_by_caller = """
    def save_checkpoint(model):
        torch.save(model.state_dict(), "m.pt")

    for epoch in range(3):
        if is_main:
            save_checkpoint(model)
    """
    assert rules(guarded_by_caller) == []
    called_from_every_rank = guarded_by_caller.replace(
        "if is_main:\n            save_checkpoint", "save_checkpoint"
    )
    assert rules(called_from_every_rank) == [("unguarded-save", 3)]


# PyTorch's "Getting Started with DDP" tutorial: run_demo(demo_fn, world_size) spawns.
RUN_DEMO = """
import torch.multiprocessing as mp

def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)
"""


def test_a_function_from_an_earlier_cell_is_checked_where_the_cell_calls_it():
    ctx = CheckContext(world_size=2, gpus=0, earlier=(RUN_DEMO,))
    (finding,) = check_source("x = 1\nrun_demo(demo_basic, 2)\n", ctx)
    assert (finding.rule, finding.line) == ("spawn-in-cell", 2)
    assert finding.message.startswith(
        "in run_demo(), defined in an earlier cell (its line 5): mp.spawn(...) starts worker "
        "processes"
    )
    # Through another function of an earlier cell, too; and not when the cell defines its own.
    wrapper = "def main():\n    run_demo(demo_basic, 2)\n"
    ctx = CheckContext(world_size=2, gpus=0, earlier=(RUN_DEMO, wrapper))
    assert rules("main()\n", ctx) == [("spawn-in-cell", 1)]
    assert rules("def run_demo(f, n):\n    f(0, n)\n\nrun_demo(demo_basic, 2)\n", ctx) == []
    assert check_source("run_demo(demo_basic, 2)\n", CPU) == []


@pytest.mark.parametrize(("rule", "bad", "good", "line"), CASES, ids=[c[0] for c in CASES])
def test_rule_fires_on_the_mistake_only(rule, bad, good, line):
    assert (rule, line) in rules(bad)
    assert rule not in [r for r, _ in rules(good)]


def test_bare_cuda_only_matters_with_several_gpus():
    cell = "model = net.cuda()\nx = x.to('cuda')\n"
    assert rules(cell, GPUS) == [("cuda-without-local-device", 1), ("cuda-without-local-device", 2)]
    # Without GPUs both ask for one that is not there.
    assert rules(cell, CPU) == [("cuda-without-gpu", 1), ("cuda-without-gpu", 2)]
    assert rules("model = net.to(device)\n", GPUS) == []
    assert rules("model = net.to(device)\n", CPU) == []


def test_finding_is_one_line_with_why_fix_and_pointer():
    (finding,) = check_source("dist.init_process_group('nccl')\n", CPU)
    text = str(finding)
    assert "\n" not in text
    assert text.startswith("nbdist check [nccl-without-gpu] line 1: ")
    assert "Use backend='gloo'" in text and "04_common_mistakes" in text


def _correct_cells():
    root = Path(__file__).parents[2]
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and cell.source.startswith("%%distrain"):
                first, body = cell.source.split("\n", 1)
                # Those show mistakes on purpose (tutorial 08 runs an uneven loop to show the hang).
                if "--check-only" not in first and "--no-check" not in first:
                    yield f"{path.name}#{i}", body
    from tests.integration import test_torch_ddp as t

    yield "TRAIN", t.train_cell()


@pytest.mark.parametrize(("where", "source"), list(_correct_cells()), ids=lambda v: str(v)[:40])
def test_no_false_alarms_on_correct_cells(where, source):
    assert check_source(source, CPU) == []


def _pointers_and_headings(constant: str) -> tuple[set[str], set[str]]:
    """The sections the checker's messages name after ``{constant}``, and the headings of the
    tutorial that constant names."""
    import re

    from nbdist.kernel import checks

    source = Path(checks.__file__).read_text()
    sections = set(re.findall(r"see \{" + constant + r"\}, '([^']+)'", source))
    nb = nbformat.read(Path(__file__).parents[2] / getattr(checks, constant), as_version=4)
    headings = {
        line.lstrip("#").strip()
        for cell in nb.cells
        if cell.cell_type == "markdown"
        for line in cell.source.splitlines()
        if line.startswith("#")
    }
    return sections, headings


def test_every_pointer_names_a_section_of_tutorial_04():
    sections, headings = _pointers_and_headings("TUTORIAL")
    assert len(sections) == 8
    assert sections <= headings, sections - headings


def test_every_pointer_to_tutorial_08_names_one_of_its_sections():
    sections, headings = _pointers_and_headings("RANKS_TUTORIAL")
    assert sections == {"One process per rank", "Uneven inputs"}
    assert sections <= headings, sections - headings
