import pytest

from nbdist.kernel import local as cluster_module


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

    from nbdist.kernel.prestart import Prestart

    cluster = cluster_module.LocalCluster()
    notify = cluster._notify
    prestart = Prestart(cluster)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        prestart.begin()
    monkeypatch.undo()
    assert not cluster.running and prestart.error is None and not prestart.pending
    assert cluster._notify is notify  # notices go where they went before
    assert cluster.before_stop is None  # a stop waits for nothing
