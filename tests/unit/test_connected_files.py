"""A healing's batch job script (Slurm, PBS, ...) goes into a folder of nbdist's own, never the
notebook's folder (where a planted link would have it overwrite a file of the user's)."""

from __future__ import annotations

import os
import stat

from nbdist.kernel.connected import ConnectedCluster
from nbdist.kernel.runfiles import run_dir


def test_a_batch_launchers_job_script_goes_into_a_private_folder(tmp_path, monkeypatch):
    from ipyparallel import Cluster

    monkeypatch.chdir(tmp_path)  # the notebook's folder, shared with another user, say
    precious = tmp_path / "precious.txt"
    precious.write_text("mine\n")
    (tmp_path / "slurm_engine.sbatch").symlink_to(precious)  # ipyparallel's default name
    cluster = Cluster(
        engine_launcher_class="slurm", load_profile=False, cluster_id="t", cluster_file="",
        profile_dir=str(tmp_path / "profile"),
    )  # fmt: skip
    connected = ConnectedCluster(notify=lambda msg: None)
    connected._private_job_script(cluster)
    launcher = cluster.engine_launcher_class(
        work_dir=".", parent=cluster, profile_dir=str(tmp_path / "profile"), cluster_id="t"
    )
    launcher.write_batch_script(2)
    script = launcher.batch_file
    assert os.path.dirname(os.path.dirname(script)) == str(run_dir())  # nbdist's own, 0700
    assert stat.S_IMODE(os.stat(os.path.dirname(script)).st_mode) == 0o700
    assert "#SBATCH" in open(script).read()
    assert precious.read_text() == "mine\n"  # the planted link was never written through
    connected.stop(note=None)
    assert not os.path.exists(os.path.dirname(script))  # gone at disconnect
