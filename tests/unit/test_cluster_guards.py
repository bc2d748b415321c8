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


def test_a_background_start_without_a_thread_leaves_nothing_to_wait_for(monkeypatch):
    """A thread that cannot start ("can't start new thread") raises where it was asked for;
    the cluster then waits for nothing (it used to wait forever for a start that never ran)."""
    import threading

    def refuse(self):
        raise RuntimeError("can't start new thread")

    cluster = cluster_module.LocalCluster()
    notify = cluster._notify
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        cluster.start_in_background()
    monkeypatch.undo()
    assert not cluster.running and cluster.background_error is None
    assert cluster._notify is notify  # notices go where they went before
