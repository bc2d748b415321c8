"""Multi-worker TensorFlow needs --expose-tf exactly where its servers would be reachable."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from nbdist.kernel.connected import ConnectedCluster
from nbdist.kernel.engines import EngineInfo
from nbdist.kernel.exposure import check_tf_exposure
from nbdist.kernel.local import LocalCluster
from nbdist.kernel.netns import PrivateNetwork
from nbdist.kernel.options import parse_run_options


def _cluster(tmp_path, *, private: bool | None, owned: bool = True) -> LocalCluster:
    cluster = LocalCluster() if owned else ConnectedCluster()
    if private is not None:
        cluster.network = PrivateNetwork(tmp_path / "x.ipc")
        if private:
            cluster.network.holder = object()  # what .private looks at
        else:
            cluster.network.reason = "NBDIST_ENGINE_NETWORK=host is set"
    if not owned:
        cluster.source = "a connected ipyparallel cluster (profile slurm)"
        cluster.engines = [
            EngineInfo(
                rank=r,
                engine_id=r,
                host=f"n{r}",
                address=f"10.0.0.{r + 1}",
                pid=1,
                gpu=None,
                visible="",
                cuda_index=None,
                cpus=1,
                local_rank=0,
                local_world_size=1,
            )
            for r in range(2)
        ]
    return cluster


def _check(cluster, framework="tf", strategy=None, allowed=False):
    told = []
    options = {"strategy": strategy} if strategy else {}
    said = getattr(cluster, "_told", False)
    cluster._told = check_tf_exposure(
        cluster, framework, options, allowed=allowed, notify=told.append, told=said
    )
    return told


def test_private_network_needs_no_flag(tmp_path):
    assert _check(_cluster(tmp_path, private=True)) == []


def test_torch_and_mirrored_never_need_it(tmp_path):
    cluster = _cluster(tmp_path, private=False)
    assert _check(cluster, framework="torch") == []
    assert _check(cluster, strategy="mirrored") == []


def test_host_network_refuses_without_the_flag(tmp_path):
    with pytest.raises(UsageError) as e:
        _check(_cluster(tmp_path, private=False))
    assert str(e.value) == (
        "%%distrain: TensorFlow's MultiWorkerMirroredStrategy starts a gRPC server in each "
        "worker that accepts code from anybody, and here anyone who can reach this machine "
        "(NBDIST_ENGINE_NETWORK=host is set) could reach them. Use --strategy mirrored (one "
        "worker, no server), or add --expose-tf to run anyway."
    )


def test_connected_cluster_refuses_without_the_flag(tmp_path):
    with pytest.raises(UsageError, match=r"anyone who can reach the engines' hosts \(10.0.0.1, "):
        _check(_cluster(tmp_path, private=None, owned=False))


def test_flag_tells_once_per_cluster(tmp_path):
    cluster = _cluster(tmp_path, private=None, owned=False)
    assert _check(cluster, allowed=True) == [
        "nbdist: --expose-tf: each TensorFlow worker's gRPC server listens on every interface "
        "of its host, with no authentication; anyone who can reach the engines' hosts "
        "(10.0.0.1, 10.0.0.2) on a connected ipyparallel cluster (profile slurm) can run code "
        "in your workers while the engines run."
    ]
    assert _check(cluster, allowed=True) == []


def test_expose_tf_flag_parses():
    assert parse_run_options("--expose-tf").expose_tf is True
    assert parse_run_options("").expose_tf is False


def test_before_a_start_the_host_network_setting_decides(monkeypatch):
    """What a stopped local cluster's configuration already decides: the engines were asked
    onto the host's network. Only a multi-worker TensorFlow job without the flag is refused."""
    from nbdist.kernel.exposure import check_tf_exposure_before_start
    from nbdist.kernel.netns import MODE_ENV

    monkeypatch.delenv(MODE_ENV, raising=False)
    check_tf_exposure_before_start("tf", {}, allowed=False)  # private: decided by the start
    monkeypatch.setenv(MODE_ENV, "host")
    check_tf_exposure_before_start("torch", {}, allowed=False)
    check_tf_exposure_before_start("tf", {"strategy": "mirrored"}, allowed=False)
    check_tf_exposure_before_start("tf", {}, allowed=True)
    with pytest.raises(UsageError, match=r"this machine \(NBDIST_ENGINE_NETWORK=host is set\)"):
        check_tf_exposure_before_start("tf", {}, allowed=False)
