"""``%distrain status`` names each rank's GPU and the memory in use on it (nvidia-smi's CSV)."""

from __future__ import annotations

from nbdist.engine import hardware, session_ops
from nbdist.engine.hardware import parse_gpu_info
from nbdist.kernel.commands import memory_lines
from nbdist.protocol import MemoryReport

# `nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total --format=csv,noheader,nounits`
# on a 2-GPU machine; GPU 1's memory is not reported (a MIG-enabled GPU prints [N/A]).
INFO = (
    "0, GPU-8e1c7a4e-2b0f-11ef-9a3c-0242ac120002, NVIDIA H200, 1234, 143771\n"
    "1, GPU-9f2d8b5f-2b0f-11ef-9a3c-0242ac120002, NVIDIA H200, [N/A], [N/A]\n"
)
MB = 2**20


def test_parse_gpu_info_by_index_or_uuid_in_the_order_asked():
    h200 = {"id": "0", "name": "NVIDIA H200", "used_mib": 1234, "total_mib": 143771}
    other = {"id": "1", "name": "NVIDIA H200", "used_mib": None, "total_mib": None}
    assert parse_gpu_info(INFO, ["0"]) == [h200]
    assert parse_gpu_info(INFO, ["1", "0"]) == [other, h200]
    assert parse_gpu_info(INFO, ["GPU-9f2d8b5f-2b0f-11ef-9a3c-0242ac120002"]) == [other]
    assert parse_gpu_info(INFO, ["7"]) == []  # not on this machine (a MIG UUID, a typo)
    assert parse_gpu_info("", ["0"]) == []


def test_status_lines_without_gpus_are_unchanged():
    reports = [
        MemoryReport(**{"rss": 812 * MB, "gpu": None, "gpus": [], "variables": 3}),
        MemoryReport(**{"rss": 790 * MB, "gpu": None, "gpus": [], "variables": 3}),
    ]
    assert memory_lines(reports) == [
        "rank     memory  gpu memory  variables",
        "   0     812 MB           -  3",
        "   1     790 MB           -  3",
    ]


def test_status_lines_name_each_ranks_gpu_and_its_memory():
    reports = [
        MemoryReport(**{"rss": 2100 * MB, "gpu": 256 * MB, "variables": 4,
         "gpus": parse_gpu_info(INFO, ["0"])}),
        MemoryReport(**{"rss": 2050 * MB, "gpu": None, "variables": 0,
         "gpus": parse_gpu_info(INFO, ["1"])}),
        MemoryReport(**{"rss": 900 * MB, "gpu": None, "variables": 0, "gpus": []}),
    ]  # fmt: skip
    assert memory_lines(reports) == [
        "rank     memory  gpu memory  variables  gpu",
        "   0    2100 MB      256 MB  4          0: NVIDIA H200, 1,234 of 143,771 MiB in use",
        "   1    2050 MB           -  0          1: NVIDIA H200, memory n/a",
        "   2     900 MB           -  0          -",
    ]
    alone = [
        MemoryReport(
            **{"rss": MB, "gpu": None, "variables": 0, "gpus": parse_gpu_info(INFO, ["0", "1"])}
        )
    ]
    assert memory_lines(alone)[1].endswith(
        "0: NVIDIA H200, 1,234 of 143,771 MiB in use; 1: NVIDIA H200, memory n/a"
    )


def test_memory_report_on_this_machine(monkeypatch):
    """The engine-side report, for real: no nvidia-smi here means no GPUs listed."""
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    report = session_ops.memory()
    assert report.gpus == [] and report.gpu is None
    assert report.rss > 10 * MB
    assert hardware.gpu_info(["0"]) == []
