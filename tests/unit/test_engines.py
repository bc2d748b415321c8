"""Ranks from engines: contiguous per host, ordered by address then engine id; one GPU each."""

from __future__ import annotations

from nbdist.kernel.engines import EngineInfo, connected_text, rank_engines, status_text
from nbdist.protocol import EngineReport


def _info(address, gpus=(), pid=100, host=None, addresses=()):
    return EngineReport(
        address=address, host=host or address, pid=pid, gpus=list(gpus), cpus=4,
        addresses=list(addresses),
    )  # fmt: skip


def test_ranks_group_by_host_address_numerically_then_by_engine_id():
    ids = [7, 3, 5, 9]
    infos = [_info("10.0.0.10"), _info("10.0.0.9"), _info("10.0.0.10"), _info("10.0.0.9")]
    engines = rank_engines(ids, infos)
    assert [
        (e.rank, e.engine_id, e.address, e.local_rank, e.local_world_size) for e in engines
    ] == [
        (0, 3, "10.0.0.9", 0, 2),
        (1, 9, "10.0.0.9", 1, 2),
        (2, 5, "10.0.0.10", 0, 2),
        (3, 7, "10.0.0.10", 1, 2),
    ]


def test_gpus_one_per_engine_all_for_an_engine_alone_none_when_too_few():
    two = rank_engines([0, 1], [_info("a", ["0", "1"]), _info("a", ["0", "1"])])
    assert [(e.gpu, e.visible, e.cuda_index) for e in two] == [("0", "0,1", 0), ("1", "0,1", 1)]
    alone = rank_engines([0], [_info("a", ["0", "1"])])
    assert [e.gpu for e in alone] == ["0,1"]  # MirroredStrategy may use every GPU
    bound = rank_engines([0, 1], [_info("a", ["3"]), _info("a", ["5"])])
    assert [e.gpu for e in bound] == ["3", "5"]  # srun --gpus-per-task=1 gave each its own
    few = rank_engines([0, 1, 2], [_info("a", ["0", "1"])] * 3)
    assert [e.gpu for e in few] == [None, None, None]  # the CPU: nccl needs a GPU per rank


def test_status_and_connected_text():
    engines = [
        EngineInfo(rank=0, engine_id=4, host="vm", address="127.0.0.1", pid=11, gpu=None,
                   visible="", cuda_index=None, cpus=2, local_rank=0, local_world_size=2),
        EngineInfo(rank=1, engine_id=5, host="vm", address="127.0.0.1", pid=12, gpu="0",
                   visible="0", cuda_index=0, cpus=2, local_rank=1, local_world_size=2),
    ]  # fmt: skip
    assert connected_text(engines) == (
        "nbdist: connected to 2 engines on 1 host (127.0.0.1: 2 engines); %distrain status "
        "shows them"
    )
    text = status_text(engines, source="a test", busy={1: 1}, warm={"torch"})
    assert text.splitlines() == [
        "nbdist: 2 workers on 1 host, a test",
        "  vm (127.0.0.1): 2 engines, ranks 0-1, GPUs 0",
        "rank  engine  host                      pid  gpu   state",
        "   0       4  vm                         11  -     idle",
        "   1       5  vm                         12  0     busy",
        "frameworks loaded: torch",
    ]


def test_an_engine_reached_over_loopback_among_several_hosts_takes_its_own_address():
    from nbdist.kernel.engines import settle_addresses

    infos = [
        _info("127.0.0.1", host="head", addresses=["10.0.0.5", "172.17.0.1"]),
        _info("10.0.0.7", host="node1", addresses=["10.0.0.7"]),
    ]
    assert [i.address for i in settle_addresses(infos, local=None)] == ["10.0.0.5", "10.0.0.7"]
    assert [i.address for i in settle_addresses(infos, local="127.0.0.1")] == ["127.0.0.1"] * 2


def test_an_engine_with_no_address_other_hosts_reach_says_what_to_set():
    import pytest

    from nbdist import ClusterError
    from nbdist.kernel.engines import settle_addresses

    infos = [
        _info("127.0.0.1", host="head"),
        _info("10.0.0.7", host="node1", addresses=["10.0.0.7"]),
    ]
    with pytest.raises(ClusterError) as e:
        settle_addresses(infos, local=None)
    assert str(e.value) == (
        "engine on head has no address other hosts can reach; set NBDIST_ADDRESS in its "
        "environment (ipcluster_config.py: c.EngineLauncher.environment) and %distrain connect "
        "again."
    )


class _HubLagging:
    """What the client sees right after a cell: its own replies are in, and the hub (which
    hears of them by the scheduler's monitor stream) still lists them, beside another
    client's task that really runs. The shape is ``Client.queue_status(verbose=True)``'s."""

    history = ["mine-1", "mine-2", "mine-3"]
    outstanding = {"mine-3"}

    def queue_status(self, verbose=False):
        assert verbose, "counts alone cannot tell this client's finished tasks"
        return {
            0: {"queue": ["mine-1"], "completed": [], "tasks": []},
            1: {"queue": ["mine-2", "theirs"], "completed": [], "tasks": []},
            2: {"queue": ["mine-3"], "completed": ["mine-0"], "tasks": []},
            "unassigned": [],
        }


def test_busy_skips_the_tasks_whose_results_this_client_already_holds():
    from nbdist.kernel.engines import RankedEngines

    cluster = RankedEngines()
    cluster._client = _HubLagging()
    cluster.engines = rank_engines([0, 1, 2, 3], [_info("a")] * 4)
    assert cluster.busy() == {0: 0, 1: 1, 2: 1, 3: 0}  # rank 3: an engine the hub dropped


class _Task:
    """Stands where ipyparallel's AsyncResult does: it has its answer, or has none yet."""

    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def get(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.value


def test_every_way_a_task_ends_is_one_reply_per_rank():
    from ipyparallel.error import RemoteError, TimeoutError

    from nbdist.kernel.engines import Status, replies

    got = replies(
        [0, 1, 2, 3],
        [
            _Task(5),
            _Task(error=RemoteError("ValueError", "boom", "")),
            _Task(error=TimeoutError("Result not ready.")),  # ipyparallel's, a builtin one
            _Task(error=RemoteError("EngineError", "Engine 3 died while running task 'x'", "")),
        ],
        1.0,
    )
    assert [(r.rank, r.status, r.value, r.ok) for r in got] == [
        (0, Status.OK, 5, True),
        (1, Status.FAILED, None, False),
        (2, Status.LATE, None, False),
        (3, Status.DIED, None, False),
    ]
    assert str(got[1].error) == "[Engine Exception] ValueError: boom"  # the error itself, kept
