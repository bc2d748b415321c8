from nbdist.engine.backends import load
from nbdist.protocol import Prepared


def test_two_local_workers_exact_env():
    """What torchrun would give two workers on one machine (libraries read it: accelerate,
    Lightning), less TORCHELASTIC_USE_AGENT_STORE."""
    envs = load("torch").rendezvous(
        ["127.0.0.1", "127.0.0.1"], [Prepared(info={"port": 29511}), Prepared()]
    )
    common = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "nbdist-127.0.0.1-29511",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "PL_TRAINER_DEVICES": "2",
        "PL_TRAINER_NUM_NODES": "1",
        "LT_DEVICES": "2",
        "LT_NUM_NODES": "1",
    }
    assert envs == [
        {**common, "RANK": "0", "LOCAL_RANK": "0", "ROLE_RANK": "0"},
        {**common, "RANK": "1", "LOCAL_RANK": "1", "ROLE_RANK": "1"},
    ]


def test_two_hosts_local_ranks_count_per_host():
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.2"]
    envs = load("torch").rendezvous(hosts, [Prepared(info={"port": 4000})] + [Prepared()] * 4)
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
        ("2", "0", "3"),
        ("3", "1", "3"),
        ("4", "2", "3"),
    ]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"}
    assert {e["WORLD_SIZE"] for e in envs} == {"5"}
    # The node of each rank, and Lightning's devices per node, as torchrun's would be.
    assert [(e["GROUP_RANK"], e["PL_TRAINER_DEVICES"]) for e in envs] == [
        ("0", "2"),
        ("0", "2"),
        ("1", "3"),
        ("1", "3"),
        ("1", "3"),
    ]
    assert {(e["GROUP_WORLD_SIZE"], e["PL_TRAINER_NUM_NODES"]) for e in envs} == {("2", "2")}


def test_unknown_framework():
    import pytest

    with pytest.raises(ValueError, match="unknown framework 'jax'; use one of: torch"):
        load("jax")
