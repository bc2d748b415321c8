"""The start notice names GPUs another process already holds memory on (nvidia-smi's CSV)."""

from __future__ import annotations

from nbdist.engine import hardware
from nbdist.engine.hardware import busy_gpus_notice, parse_gpu_holders
from nbdist.kernel import local as cluster_module

# What `nvidia-smi --query-gpu=index,uuid --format=csv,noheader,nounits` and
# `--query-compute-apps=gpu_uuid,pid,used_memory` print on a 2-GPU machine where another user's
# job holds GPU 1 and one process reports no figure.
GPUS = "0, GPU-8e1c7a4e-2b0f-11ef-9a3c-0242ac120002\n1, GPU-9f2d8b5f-2b0f-11ef-9a3c-0242ac120002\n"
APPS = (
    "GPU-9f2d8b5f-2b0f-11ef-9a3c-0242ac120002, 41377, 10240\n"
    "GPU-9f2d8b5f-2b0f-11ef-9a3c-0242ac120002, 41390, 512\n"
    "GPU-8e1c7a4e-2b0f-11ef-9a3c-0242ac120002, 5120, [N/A]\n"
)


def test_parse_holders_per_gpu_index():
    assert parse_gpu_holders(GPUS, APPS) == {
        "1": [(41377, 10240), (41390, 512)],
        "0": [(5120, None)],
    }
    assert parse_gpu_holders(GPUS, "") == {}
    assert parse_gpu_holders("", APPS) == {}  # an app on an unknown GPU is not guessed at


def test_notice_names_busy_visible_gpus():
    holders = parse_gpu_holders(GPUS, APPS)
    assert busy_gpus_notice(["1"], holders, me=1) == (
        "nbdist: another process already uses a GPU the workers will use (GPU 1: 10,752 MiB "
        "held by pids 41377, 41390): they share its memory and compute. Set "
        "CUDA_VISIBLE_DEVICES to choose others."
    )
    assert busy_gpus_notice(["0", "1"], holders, me=5120).startswith(
        "nbdist: another process already uses a GPU the workers will use (GPU 0: memory held "
        "by pid 5120 (this kernel); GPU 1: 10,752 MiB held by pids 41377, 41390)"
    )


def test_no_notice_when_free_or_without_nvidia_smi(monkeypatch):
    assert busy_gpus_notice(["0"], parse_gpu_holders(GPUS, ""), me=1) is None
    assert busy_gpus_notice([], parse_gpu_holders(GPUS, APPS), me=1) is None
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    assert hardware.gpu_holders() == {}


def test_start_shows_the_notice_first(monkeypatch):
    """LocalCluster.start says it before anything starts (here the start then stops early)."""
    told = []
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: ["1"])
    monkeypatch.setattr(cluster_module, "gpu_holders", lambda: parse_gpu_holders(GPUS, APPS))

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    monkeypatch.setattr(cluster_module, "clean_stale", stop)
    cluster = cluster_module.LocalCluster(notify=told.append)
    try:
        cluster.start(1)
    except Stop:
        pass
    assert told == [
        busy_gpus_notice(["1"], parse_gpu_holders(GPUS, APPS), me=cluster_module.os.getpid())
    ]
