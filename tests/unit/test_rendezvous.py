from nbdist.engine.backends import load


def test_two_local_workers_exact_env():
    envs = load("torch").rendezvous(["127.0.0.1", "127.0.0.1"], [{"port": 29511}, {}])
    assert envs == [
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29511",
        },
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29511",
        },
    ]


def test_two_hosts_local_ranks_count_per_host():
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.2"]
    envs = load("torch").rendezvous(hosts, [{"port": 4000}, {}, {}, {}, {}])
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
        ("2", "0", "3"),
        ("3", "1", "3"),
        ("4", "2", "3"),
    ]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"}
    assert {e["WORLD_SIZE"] for e in envs} == {"5"}


def test_unknown_framework():
    import pytest

    with pytest.raises(ValueError, match="unknown framework 'jax'; use one of: torch"):
        load("jax")
