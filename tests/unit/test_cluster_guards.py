import os
import subprocess
import sys

import psutil
import pytest
from IPython.core.error import UsageError

from nbdist.kernel import cluster as cluster_module
from nbdist.kernel.cluster import LocalCluster, clean_stale


def test_more_workers_than_gpus_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: ["0"])
    with pytest.raises(UsageError, match="-n 2 asks for more workers than the 1 visible GPUs"):
        LocalCluster()._check_gpus(2)
    LocalCluster()._check_gpus(1)


def test_default_workers(monkeypatch):
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: ["0", "1", "2"])
    assert cluster_module.default_workers() == 3
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: [])
    assert cluster_module.default_workers() == 2


def test_stale_cluster_of_a_dead_kernel_is_cleaned(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    alive_kernel = os.getpid()
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (tmp_path / f"nbdist-{dead.pid}-abc.pids").write_text(f"{leftover.pid}")
        (tmp_path / f"nbdist-{alive_kernel}-def.pids").write_text(f"{mine.pid}")
        assert clean_stale(str(tmp_path)) == 1
        assert leftover.wait(timeout=10) != 0
        assert mine.poll() is None  # a live kernel's cluster is left alone
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"nbdist-{alive_kernel}-def.pids"]
    finally:
        for proc in (leftover, mine):
            if psutil.pid_exists(proc.pid):
                proc.kill()
            proc.wait()
