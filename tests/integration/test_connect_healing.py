"""Healing a connected cluster: ``ipcluster start`` (ipyparallel's local launcher, its cluster
file in the profile) runs three engines nbdist did not start; ``%distrain connect`` attaches.
A rank killed in the middle of a DDP training cell is replaced by an engine the cluster's own
launcher starts, and gets a survivor's variables; the next cell trains on with every replica
equal. (A cluster whose engines were started by hand has no launcher to ask: the survivors go
on alone, see test_connect.py's last test.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.integration.test_healing import BUILD, TRAIN, train_and_kill
from tests.procs import gone_or_zombie

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

CLUSTER_ID = "nbdist-heal"


def _ipcluster(profile, *args):
    return [
        sys.executable, "-m", "ipyparallel.cluster", *args, f"--profile-dir={profile}",
        f"--cluster-id={CLUSTER_ID}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``ipcluster start -n 3`` in a profile of its own; ``ipcluster stop`` at the end, and
    no engine left (the one the launcher started for nbdist included)."""
    profile = tmp_path_factory.mktemp("profile_launched")
    # A lost engine is noticed after 3 s of missed heartbeats, not ipyparallel's 30.
    (profile / "ipcontroller_config.py").write_text(
        "c.IPController.ip = '127.0.0.1'\n"
        "c.HeartMonitor.period = 500\n"
        "c.HeartMonitor.max_heartmonitor_misses = 6\n"
    )
    log = open(profile / "ipcluster.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        _ipcluster(profile, "start", "-n", "3"), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    cluster_file = profile / "security" / f"cluster-{CLUSTER_ID}.json"
    deadline = time.monotonic() + 60
    while not cluster_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            profile / "ipcluster.log"
        ).read_text()
        time.sleep(0.2)
    try:
        yield profile
    finally:
        subprocess.run(_ipcluster(profile, "stop"), timeout=60, capture_output=True)
        proc.wait(60)
        log.close()
        engines = [
            p for p in psutil.process_iter(["cmdline"])
            if str(profile) in " ".join(p.info["cmdline"] or [])
        ]  # fmt: skip
        _, alive = psutil.wait_procs(engines, timeout=15)
        assert not alive, [p.info["cmdline"] for p in alive]


def test_a_rank_killed_mid_cell_gets_an_engine_from_the_clusters_launcher(
    shell, launched, magics, capsys, tmp_path
):
    sh = shell
    sh.run_line_magic(
        "distrain", f"connect --profile-dir {launched} --cluster-id {CLUSTER_ID} --timeout 60 -n 3"
    )
    try:
        sh.run_cell_magic("distrain", "--framework torch --no-plot", BUILD)
        sh.user_ns.update(STEPS=3, PAUSE=0.0)
        sh.run_cell_magic("distrain", "--no-plot -o res --push STEPS,PAUSE", TRAIN)
        assert [done for done, _, _ in sh.user_ns["res"].values] == [3] * 3
        victim = magics.cluster.engines[1]
        before = {e.pid for e in magics.cluster.engines}
        capsys.readouterr()
        error, killed = train_and_kill(sh, tmp_path, [victim.pid], 3)
        took = time.monotonic() - killed
        message = str(error)
        assert message.startswith(
            f"rank 1 (host {victim.host}, pid {victim.pid}) stopped answering during the job"
        ), message
        assert message.splitlines()[-1].startswith(
            "The session was healed: a new engine took rank 1, and every rank got rank 0's "
            "variables (PAUSE, STEPS, X, Y, done, g, loss, model, opt, step) and imports (time); "
            "the next cell wraps model in DistributedDataParallel again, on a new process group. "
            "Values the cells computed from the rank (a gpu_id = LOCAL_RANK, a shard of your "
            "own) are rank 0's on every rank now: set them again."
        ), message
        said = capsys.readouterr()
        assert (
            "nbdist: the cluster's launcher (LocalEngineSetLauncher) started 1 new engine (nbdist "
            "stops it when it disconnects)\n" in said.out
        ), said
        assert "Engine 0 not running" not in said.out + said.err, said  # ipyparallel's log
        # From the kill: the heartbeat (3 s), the collective's timeout, a new engine.
        assert took < 30, took
        now = [e.pid for e in magics.cluster.engines]
        assert len(now) == 3 and len(set(now) - before) == 1 and victim.pid not in now
        (started,) = set(now) - before
        nanny = [c.pid for c in psutil.Process(started).children()]
        sh.user_ns.update(STEPS=2, PAUSE=0.0)
        sh.run_cell_magic("distrain", "--no-plot -o res --push STEPS,PAUSE", TRAIN)
        done = sh.user_ns["res"].values
        assert len(set(done)) == 1 and done[0][2] == "DistributedDataParallel", done
        for name in ("model", "opt"):
            same = sh.run_line_magic("distrain", f"compare {name}")
            assert same.identical, (name, same)
    finally:
        sh.run_line_magic("distrain", "stop")
    # nbdist started that engine, and nobody else knows of it (ipcluster's cluster file does
    # not list it): disconnecting stopped it, and its nanny; the engines ipcluster started run on.
    assert nanny and all(gone_or_zombie(pid) for pid in [started, *nanny])
    assert all(psutil.pid_exists(pid) for pid in before - {victim.pid})


def test_a_config_file_others_could_write_is_not_run_and_the_heal_says_why(
    shell, launched, magics, capsys, tmp_path
):
    """The profile's ipcluster_config.py, group-writable (umask 002's), would run in this kernel
    when nbdist starts engines with the cluster's launcher: it is refused, said in one line
    with the fix, and the survivor goes on alone."""
    sh = shell
    marker = tmp_path / "ran"
    config = launched / "ipcluster_config.py"
    config.write_text(f"open({str(marker)!r}, 'w').close()\n")
    config.chmod(0o664)
    try:
        sh.run_line_magic(
            "distrain", f"connect --profile-dir {launched} --cluster-id {CLUSTER_ID} -n 2"
        )
        sh.run_cell_magic("distrain", "--framework torch --no-plot", "kept = rank\n")
        victim = magics.cluster.engines[1]
        os.kill(victim.pid, signal.SIGKILL)
        assert gone_or_zombie(victim.pid)
        capsys.readouterr()
        deadline = time.monotonic() + 30  # the controller notices after 3 s of heartbeats
        while not magics.cluster.dead(range(magics.cluster.size)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert sh.run_cell_magic("distrain", "--no-plot", "kept\n") == 0
        said = capsys.readouterr().out
        assert (
            f"nbdist: the cluster's launcher was not used: the config file {config} is writable "
            "by other users (mode 664), who could then run code in this kernel. If it is yours, "
            f"run: chmod go-w {config}\n" in said
        ), said
        assert "the session was healed on fewer ranks" in said, said
        assert not marker.exists()
    finally:
        sh.run_line_magic("distrain", "stop")
        config.unlink()
