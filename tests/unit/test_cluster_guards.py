import pytest
from IPython.core.error import UsageError

from nbdist.kernel import cluster as cluster_module


def test_more_workers_than_gpus_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: ["0"])
    with pytest.raises(UsageError, match="-n 2 asks for more workers than the 1 visible GPUs"):
        cluster_module._check_gpus(2)
    cluster_module._check_gpus(1)


def test_default_workers(monkeypatch):
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: ["0", "1", "2"])
    assert cluster_module.default_workers() == 3
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: [])
    assert cluster_module.default_workers() == 2
