"""Which GPU each engine gets: from what ``CUDA_VISIBLE_DEVICES`` / ``nvidia-smi -L`` show, through
the ranking of engines per host, to the ``CUDA_VISIBLE_DEVICES`` each engine is left with and the
``cuda:<index>`` it uses (its local rank, as under torchrun)."""

from __future__ import annotations

import pytest

from nbdist.engine import hardware, worker
from nbdist.engine.backends.torch_ddp import rendezvous
from nbdist.engine.hardware import listed_gpus, parse_visible_devices, visible_gpus
from nbdist.engine.state import engine_state
from nbdist.kernel.engines import gpus_for_host, rank_engines
from nbdist.kernel.local import more_workers_than_gpus
from nbdist.protocol import EngineReport, Prepared

# `nvidia-smi -L` on an 8-GPU machine, and on one whose GPU 0 is split into MIG instances.
SMI_8 = "".join(
    f"GPU {i}: NVIDIA H200 (UUID: GPU-{i}a1c7a4e-2b0f-11ef-9a3c-0242ac12000{i})\n" for i in range(8)
)
SMI_MIG = (
    "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d3f0c1e-aaaa-bbbb-cccc-0242ac120002)\n"
    "  MIG 1g.5gb      Device  0: (UUID: MIG-1f2e3d4c-aaaa-bbbb-cccc-0242ac120002)\n"
    "  MIG 1g.5gb      Device  1: (UUID: MIG-2f2e3d4c-aaaa-bbbb-cccc-0242ac120002)\n"
    "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-6d3f0c1e-aaaa-bbbb-cccc-0242ac120002)\n"
)


def _info(address, gpus, pid=100):
    return EngineReport(address=address, host=f"h{address}", pid=pid, gpus=gpus, cpus=16)


def _local_cluster(n, seen):
    """``n`` engines started by this kernel: each inherits the kernel's view of the GPUs."""
    return rank_engines(list(range(n)), [_info("127.0.0.1", list(seen)) for _ in range(n)])


@pytest.fixture
def restore_pin(monkeypatch):
    """use_gpus changes this process's environment and engine state: put both back after."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    state = engine_state()
    before = state.cuda_index
    yield monkeypatch
    state.cuda_index = before


def test_cuda_visible_devices_as_cuda_reads_it():
    assert parse_visible_devices("3,5") == ["3", "5"]
    assert parse_visible_devices(" 2 , 7 ") == ["2", "7"]
    assert parse_visible_devices("") == []
    assert parse_visible_devices("-1") == []
    assert parse_visible_devices("0,-1,1") == ["0"]  # CUDA stops at the first invalid entry
    assert parse_visible_devices("1,,2") == ["1"]
    assert parse_visible_devices("GPU-8e1c7a4e-2b0f,GPU-9f2d8b5f-2b0f") == [
        "GPU-8e1c7a4e-2b0f",
        "GPU-9f2d8b5f-2b0f",
    ]


def test_nvidia_smi_listing_counts_gpus_not_mig_instances():
    assert listed_gpus(SMI_8) == ["0", "1", "2", "3", "4", "5", "6", "7"]
    assert listed_gpus(SMI_MIG) == ["0", "1"]
    assert listed_gpus("") == []


def test_visible_gpus_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)  # a machine without GPUs
    assert visible_gpus() == []


@pytest.mark.parametrize(
    ("seen", "n", "expected"),
    [
        (["0"], 1, [("0", "0", 0)]),
        (["0", "1"], 2, [("0", "0,1", 0), ("1", "0,1", 1)]),
        (["0", "1"], 1, [("0,1", "0,1", 0)]),  # alone: MirroredStrategy may use both
        (listed_gpus(SMI_8), 8, [(str(r), "0,1,2,3,4,5,6,7", r) for r in range(8)]),
        (listed_gpus(SMI_8), 4, [(str(r), "0,1,2,3", r) for r in range(4)]),
        (listed_gpus(SMI_8), 1, [("0,1,2,3,4,5,6,7", "0,1,2,3,4,5,6,7", 0)]),
        (parse_visible_devices("3,5"), 2, [("3", "3,5", 0), ("5", "3,5", 1)]),
        (parse_visible_devices("3,5"), 1, [("3,5", "3,5", 0)]),
        ([], 2, [(None, "", None), (None, "", None)]),  # CPU only
        (["0"], 2, [(None, "", None), (None, "", None)]),  # 1 GPU, 2 workers (Colab): the CPU
    ],
)
def test_local_engines_see_their_hosts_gpus_and_use_their_local_ranks(seen, n, expected):
    engines = _local_cluster(n, seen)
    assert [(e.gpu, e.visible, e.cuda_index) for e in engines] == expected
    assert [(e.rank, e.local_rank, e.local_world_size) for e in engines] == [
        (r, r, n) for r in range(n)
    ]


def test_more_engines_than_gpus_use_the_cpu_and_the_start_says_how_to_use_the_gpus(
    monkeypatch,
):
    assert [e.gpu for e in _local_cluster(3, ["0", "1"])] == [None, None, None]
    # Engines a launcher bound to one GPU each (srun --gpus-per-task=1) keep theirs, as cuda:0.
    bound = rank_engines([0, 1, 2], [_info("10.0.0.1", [g]) for g in ("4", "6", "7")])
    assert [(e.gpu, e.visible, e.cuda_index) for e in bound] == [
        ("4", "4", 0),
        ("6", "6", 0),
        ("7", "7", 0),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert more_workers_than_gpus(2) == (
        "nbdist: 2 workers for 1 GPU: the workers use the CPU (gloo), since with nccl each needs "
        "a GPU of its own; -n 1 puts one on the GPU."
    )
    assert more_workers_than_gpus(1) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert more_workers_than_gpus(4) == (
        "nbdist: 4 workers for 2 GPUs: the workers use the CPU (gloo), since with nccl each needs "
        "a GPU of its own; -n 2 puts one on each GPU."
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert more_workers_than_gpus(2) is None  # no GPU at all: CPU workers as always


def test_gpus_for_host_by_local_rank():
    assert gpus_for_host([["3", "5"], ["3", "5"]]) == [("3", "3,5", 0), ("5", "3,5", 1)]
    assert gpus_for_host([["3", "5"]]) == [("3,5", "3,5", 0)]
    assert gpus_for_host([[]]) == [(None, "", None)]
    assert gpus_for_host([["0", "1"]] * 3) == [(None, "", None)] * 3


def test_two_hosts_local_ranks_and_gpus():
    """Host 10.0.0.2 shows all 4 of its GPUs; 10.0.0.10 was started with CUDA_VISIBLE_DEVICES=3,5.
    Engine ids arrive interleaved; ranks are contiguous per host, GPUs follow the local rank."""
    ids = [0, 1, 2, 3, 4]
    four, pair = listed_gpus(SMI_8)[:4], parse_visible_devices("3,5")
    infos = [
        _info("10.0.0.10", pair, pid=20),
        _info("10.0.0.2", four, pid=10),
        _info("10.0.0.10", pair, pid=21),
        _info("10.0.0.2", four, pid=11),
        _info("10.0.0.2", four, pid=12),
    ]
    engines = rank_engines(ids, infos)
    assert [(e.rank, e.engine_id, e.address, e.local_rank, e.local_world_size, e.gpu,
             e.visible, e.cuda_index) for e in engines] == [
        (0, 1, "10.0.0.2", 0, 3, "0", "0,1,2", 0),
        (1, 3, "10.0.0.2", 1, 3, "1", "0,1,2", 1),
        (2, 4, "10.0.0.2", 2, 3, "2", "0,1,2", 2),
        (3, 0, "10.0.0.10", 0, 2, "3", "3,5", 0),
        (4, 2, "10.0.0.10", 1, 2, "5", "3,5", 1),
    ]  # fmt: skip
    # torch's per-rank environment agrees on the local ranks.
    envs = rendezvous(
        [e.address for e in engines], [Prepared(info={"port": 29400})] + [Prepared()] * 4
    )
    assert [(env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) for env in envs] == [
        ("0", "3"),
        ("1", "3"),
        ("2", "3"),
        ("0", "2"),
        ("1", "2"),
    ]
    assert {env["MASTER_ADDR"] for env in envs} == {"10.0.0.2"}


def test_one_engine_per_host_gets_all_its_gpus():
    engines = rank_engines([5, 6], [_info("10.0.0.2", ["0", "1"]), _info("10.0.0.3", ["2"])])
    assert [(e.rank, e.local_rank, e.local_world_size, e.gpu) for e in engines] == [
        (0, 0, 1, "0,1"),
        (1, 0, 1, "2"),
    ]


def test_each_engine_is_left_its_hosts_gpus_and_its_device(restore_pin):
    """What each engine of a local cluster ends with, as CUDA will read it at initialisation."""
    restore_pin.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # what every engine inherits
    engines = _local_cluster(2, visible_gpus())
    seen = []
    for e in engines:
        worker.use_gpus(e.visible, e.cuda_index)
        seen.append((hardware.os.environ["CUDA_VISIBLE_DEVICES"], engine_state().cuda_index))
    assert seen == [("3,5", 0), ("3,5", 1)]
    worker.use_gpus("", None)  # a CPU worker on a machine with GPUs: CUDA sees none
    assert parse_visible_devices(hardware.os.environ["CUDA_VISIBLE_DEVICES"]) == []
    assert engine_state().cuda_index is None
