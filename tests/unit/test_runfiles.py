"""Run files: a private folder, records read only when ours, processes killed only when still
the ones recorded."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nbdist.errors import ClusterError
from nbdist.kernel import reaper, runfiles
from nbdist.kernel.runfiles import RunRecord, clean_stale, kill_tree, same_process

OTHER_UID = 4242


@pytest.fixture
def sleepers():
    procs = []

    def start():
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _ct(pid: int) -> float:
    """The process's start as a record holds it: clock ticks since boot, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _boot() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _record(path, kernel, procs, mode=0o600, boot=None):
    path.write_text(
        json.dumps(
            {
                "kernel": list(kernel),
                "boot": _boot() if boot is None else boot,
                "started": [list(p) for p in procs],
            }
        )
    )
    path.chmod(mode)
    return path


def test_stale_record_of_a_dead_kernel_is_cleaned(tmp_path, sleepers):
    leftover, mine = sleepers(), sleepers()
    me = (os.getpid(), _ct(os.getpid()))
    _record(tmp_path / "nbdist-1-abc.pids", (_dead_pid(), 1.0), [(leftover.pid, _ct(leftover.pid))])
    _record(tmp_path / f"nbdist-{me[0]}-def.pids", me, [(mine.pid, _ct(mine.pid))])
    assert clean_stale(tmp_path) == 1
    assert leftover.wait(timeout=10) == -9
    assert mine.poll() is None  # a live kernel's cluster is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"nbdist-{me[0]}-def.pids"]


def test_record_whose_pid_is_now_another_process_kills_nothing(tmp_path, sleepers):
    """After a reboot (persistent /tmp) or PID reuse the PID names an unrelated process."""
    other = sleepers()
    _record(tmp_path / "nbdist-1-abc.pids", (_dead_pid(), 1.0), [(other.pid, _ct(other.pid) - 60)])
    assert clean_stale(tmp_path) == 0
    time.sleep(0.2)
    assert other.poll() is None
    assert [p.name for p in tmp_path.iterdir()] == []  # the stale record itself is removed


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file owned by another uid needs root")
def test_foreign_record_naming_our_live_process_is_ignored(tmp_path, sleepers):
    victim = sleepers()
    planted = _record(
        tmp_path / "nbdist-1-abc.pids", (_dead_pid(), 1.0), [(victim.pid, _ct(victim.pid))]
    )
    os.chown(planted, OTHER_UID, OTHER_UID)
    assert clean_stale(tmp_path) == 0
    time.sleep(0.2)
    assert victim.poll() is None
    assert planted.exists()  # not ours to delete either


def test_world_writable_record_is_ignored(tmp_path, sleepers):
    victim = sleepers()
    _record(
        tmp_path / "nbdist-1-abc.pids",
        (_dead_pid(), 1.0),
        [(victim.pid, _ct(victim.pid))],
        mode=0o666,
    )
    assert clean_stale(tmp_path) == 0
    time.sleep(0.2)
    assert victim.poll() is None


def test_unreadable_records_do_not_stop_the_cleaning(tmp_path, sleepers):
    leftover = sleepers()
    (tmp_path / "nbdist-2-dir.pids").mkdir()
    os.mkfifo(tmp_path / "nbdist-3-fifo.pids")  # opening a FIFO to read would block
    (tmp_path / "nbdist-4-link.pids").symlink_to(tmp_path / "missing")
    _record(tmp_path / "nbdist-5-garbage.pids", (1, 1.0), []).write_text("not json")
    locked = _record(tmp_path / "nbdist-6-locked.pids", (_dead_pid(), 1.0), [], mode=0)
    if os.geteuid() == 0:
        os.chown(locked, OTHER_UID, OTHER_UID)
    _record(tmp_path / "nbdist-1-abc.pids", (_dead_pid(), 1.0), [(leftover.pid, _ct(leftover.pid))])
    assert clean_stale(tmp_path) == 1
    assert leftover.wait(timeout=10) == -9


def test_kill_tree_kills_descendants(sleepers):
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print('up', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout.readline() == "up\n"
        child = psutil.Process(parent.pid).children()[0]
        assert kill_tree((parent.pid, _ct(parent.pid)))
        assert parent.wait(timeout=10) == -9
        child.wait(timeout=10)
        assert not child.is_running()
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()


def test_kill_tree_kills_what_outlived_a_session_leader(sleepers):
    """A controller stopped while it starts exits before its children: they have no parent
    left, but stay in the session it led (ipyparallel starts each in a session of its own)."""
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print(c.pid, flush=True)",  # and exits: its child is orphaned
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    created = _ct(leader.pid)
    orphan = psutil.Process(int(leader.stdout.readline()))
    assert leader.wait(timeout=10) == 0
    try:
        assert not same_process((leader.pid, created))
        assert [p.pid for p in runfiles.tree_of((leader.pid, created))] == [orphan.pid]
        assert kill_tree((leader.pid, created))
        orphan.wait(timeout=10)
        assert runfiles.tree_of((leader.pid, created)) == []
        assert not kill_tree((leader.pid, created))
    finally:
        if orphan.is_running():
            orphan.kill()


def test_reaper_stop_kills_what_is_left_after_the_grace(tmp_path, sleepers):
    """A normal stop removes the record; a recorded process that did not exit meanwhile (a
    signal that did not take) is killed first, not left running."""
    stubborn = sleepers()
    reap = runfiles.Reaper(tmp_path)
    reap.record.write([stubborn.pid])
    reap.stop(grace_s=0.2)
    assert stubborn.wait(timeout=10) == -9
    assert not reap.record.path.exists()
    assert reap.process.poll() is not None


def test_same_process_compares_the_start(sleepers):
    proc = sleepers()
    assert same_process((proc.pid, _ct(proc.pid)))
    assert not same_process((proc.pid, _ct(proc.pid) + 0.01))  # one tick later: another one
    assert not same_process((_dead_pid(), 1.0))


def test_a_clock_that_is_set_changes_no_identity(tmp_path, sleepers, monkeypatch):
    """psutil's create time is the boot time (which moves when the clock is set: NTP) plus the
    start: the record's identity is the start alone, so a live kernel stays alive."""
    proc = sleepers()
    record = RunRecord(tmp_path)
    record.write([proc.pid])
    import psutil._pslinux as pslinux

    real = pslinux.boot_time
    monkeypatch.setattr(pslinux, "boot_time", lambda: real() + 1.0)
    moved = psutil.Process(proc.pid).create_time() - (real() + _ct(proc.pid))
    assert moved == pytest.approx(1.0, abs=0.02)  # what psutil says moved by the second
    assert same_process(record.kernel) and same_process(record.procs[0])
    assert clean_stale(tmp_path) == 0
    assert proc.poll() is None
    record.remove()


def test_a_record_of_an_earlier_boot_kills_nothing(tmp_path, sleepers):
    """After a reboot PIDs and starts begin again: an old record's (pid, start) may match a
    new process exactly, and only the boot id tells them apart."""
    victim = sleepers()
    _record(
        tmp_path / "nbdist-1-abc.pids",
        (_dead_pid(), 1.0),
        [(victim.pid, _ct(victim.pid))],
        boot="00000000-0000-0000-0000-000000000000",
    )
    assert clean_stale(tmp_path) == 0
    time.sleep(0.2)
    assert victim.poll() is None
    assert list(tmp_path.iterdir()) == []  # the stale record itself is removed


def test_a_session_whose_leaders_pid_names_another_process_now_is_left_alone(sleepers):
    """A recorded session leader that is gone, its PID now held by another process that leads
    a session of its own (another cluster's engine, once PIDs wrapped): that session is not
    the recorded one, and nothing in it is swept up."""
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    try:
        recorded = (other.pid, _ct(other.pid) - 30)  # the same PID, started long before
        assert runfiles.tree_of(recorded) == []
        assert not kill_tree(recorded)
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_reaper_treats_a_recycled_kernel_pid_as_gone(tmp_path, sleepers):
    """The kernel is matched by (pid, create time): our own PID with another create time is a
    different process, so the reaper kills the cluster's processes."""
    leftover = sleepers()
    path = _record(
        tmp_path / "nbdist-x.pids",
        (os.getpid(), _ct(os.getpid()) - 60),
        [(leftover.pid, _ct(leftover.pid))],
    )
    sockets = runfiles.sockets_of(path)
    sockets.mkdir(mode=0o700)
    (sockets / "s-1234").write_text("")
    reaper.watch(str(path))
    assert leftover.wait(timeout=10) == -9
    assert list(tmp_path.iterdir()) == []  # the record and its sockets folder are gone


def test_run_record_is_private_and_atomic(tmp_path, sleepers):
    proc = sleepers()
    record = RunRecord(tmp_path)
    record.write([proc.pid, _dead_pid(), None])
    st = os.stat(record.path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert json.loads(record.path.read_text()) == {
        "kernel": [os.getpid(), _ct(os.getpid())],
        "boot": _boot(),
        "started": [[proc.pid, _ct(proc.pid)]],
        "jobs": [],
    }
    assert [p.name for p in tmp_path.iterdir()] == [record.path.name]  # no temporary left
    assert record.path.name.startswith(f"nbdist-{os.getpid()}-")
    assert record.sockets == tmp_path / (record.path.stem + ".ipc")
    record.remove()
    assert list(tmp_path.iterdir()) == []


def test_run_dir_is_made_private(tmp_path, monkeypatch):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    monkeypatch.setattr(runfiles, "run_dir_candidates", lambda: [loose])
    assert runfiles.run_dir() == loose
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o700
    fresh = tmp_path / "a" / "nbdist"
    monkeypatch.setattr(runfiles, "run_dir_candidates", lambda: [fresh])
    assert runfiles.run_dir() == fresh
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700


def test_run_dir_candidates_prefer_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter"))
    assert runfiles.run_dir_candidates() == [
        tmp_path / "nbdist",
        tmp_path / "jupyter" / "nbdist",
        runfiles.Path(runfiles.tempfile.gettempdir()) / f"nbdist-{os.getuid()}",
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="a folder owned by another uid needs root")
def test_run_dir_skips_a_folder_someone_else_owns(tmp_path, monkeypatch):
    planted, mine = tmp_path / "planted", tmp_path / "mine"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    monkeypatch.setattr(runfiles, "run_dir_candidates", lambda: [planted, mine])
    assert runfiles.run_dir() == mine
    monkeypatch.setattr(runfiles, "run_dir_candidates", lambda: [planted])
    with pytest.raises(ClusterError, match=r"no private folder for its run files \(.*planted: "):
        runfiles.run_dir()


def test_run_dir_refuses_a_symlink(tmp_path, monkeypatch):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    monkeypatch.setattr(runfiles, "run_dir_candidates", lambda: [link])
    with pytest.raises(ClusterError, match="is not a directory owned by uid"):
        runfiles.run_dir()


def test_a_write_that_cannot_replace_the_file_leaves_no_temporary_behind(tmp_path):
    """``os.replace`` onto a folder fails: the error reaches the caller and the temporary file
    it wrote is gone (the old content stays)."""
    target = tmp_path / "record"
    target.mkdir()
    (target / "kept").write_text("old")
    with pytest.raises(IsADirectoryError):
        runfiles.write_atomic(target, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record"]
    assert [p.name for p in target.iterdir()] == ["kept"]


def test_run_dir_skips_a_folder_too_deep_for_the_controllers_sockets(tmp_path, monkeypatch):
    """A socket path has at most 107 bytes: below a deeper folder the controller could not bind
    and exited at once. Such a folder is passed over for the next one."""
    deep = tmp_path / ("d" * (runfiles.SOCKET_PATH_MAX - len(str(tmp_path))))
    short = tmp_path / "short"
    monkeypatch.setattr(runfiles, "run_dir_candidates", lambda: [deep / "nbdist", short])
    assert runfiles.run_dir() == short
    assert not deep.exists()
    monkeypatch.setattr(runfiles, "run_dir_candidates", lambda: [deep / "nbdist"])
    length = runfiles.longest_socket_path(deep / "nbdist")
    with pytest.raises(ClusterError) as info:
        runfiles.run_dir()
    assert str(info.value) == (
        f"nbdist found no private folder for its run files ({deep / 'nbdist'}: too deep for the "
        f"controller's sockets ({length} bytes, at most 107)). Set XDG_RUNTIME_DIR to a short "
        "folder only you can write, then %distrain start again."
    )


def test_the_longest_socket_path_is_the_one_a_cluster_binds(tmp_path):
    """The controller's sockets: <record>.ipc/s-PORT, linked as s:PORT; a record is
    nbdist-<pid>-<8 random>.pids, and PIDs go up to 4194304."""
    record = runfiles.RunRecord(tmp_path)
    try:
        name = record.path.name
        assert name.startswith(f"nbdist-{os.getpid()}-") and len(name) == len(
            f"nbdist-{os.getpid()}-abcdefgh.pids"
        )
        real = len(os.fsencode(record.sockets / "s:65535"))
        assert runfiles.longest_socket_path(tmp_path) == real + 7 - len(str(os.getpid()))
    finally:
        record.remove()


def test_a_recorded_pid_keeps_its_identity_across_writes(tmp_path, sleepers):
    """A stop kills what the record names: a PID written again must still be the process first
    recorded, never whatever process has that PID now (PIDs wrap, at 32768 here)."""
    record = RunRecord(tmp_path)
    a, b = sleepers(), sleepers()
    record.write([a.pid, b.pid])
    first = dict(record.procs)
    record.procs = [(a.pid, first[a.pid]), (b.pid, first[b.pid] - 100)]  # b's PID: reused since
    record.write([a.pid, b.pid])
    assert record.procs == [(a.pid, first[a.pid])]
    a.kill()
    a.wait()
    record.write([a.pid])
    assert record.procs == []
    record.remove()


def test_a_record_an_older_nbdist_wrote_is_left_to_it(tmp_path, sleepers):
    """Wall-clock create times under "procs": nothing here can compare with them, so the record
    (perhaps of a kernel still running that version) is neither acted on nor removed."""
    victim = sleepers()
    old = tmp_path / "nbdist-1-abc.pids"
    old.write_text(
        json.dumps(
            {
                "kernel": [_dead_pid(), 1.0],
                "procs": [[victim.pid, psutil.Process(victim.pid).create_time()]],
            }
        )
    )
    old.chmod(0o600)
    assert clean_stale(tmp_path) == 0
    time.sleep(0.2)
    assert victim.poll() is None
    assert [p.name for p in tmp_path.iterdir()] == [old.name]


def test_socket_paths_fit_the_platform(tmp_path, monkeypatch):
    """macOS (and the BSDs) take 103-byte socket paths, not 107: a folder that fits on Linux
    may be too deep there."""
    assert runfiles.socket_path_max("linux") == 107
    assert runfiles.socket_path_max("darwin") == 103
    folder = tmp_path / (
        "d" * (105 - len(str(tmp_path / "nbdist-4194304-abcdefgh.ipc" / "s:65535")))
    )
    assert runfiles.longest_socket_path(folder) == 106
    monkeypatch.setattr(runfiles, "run_dir_candidates", lambda: [folder])
    assert runfiles.run_dir() == folder
    monkeypatch.setattr(runfiles.sys, "platform", "darwin")
    with pytest.raises(ClusterError, match=r"\(106 bytes, at most 103\)"):
        runfiles.run_dir()


def test_processes_are_known_without_proc(monkeypatch):
    """Without /proc (macOS), psutil's create time stands for a process's start."""
    import psutil

    monkeypatch.setattr(runfiles, "_HAS_PROC", False)
    me = (os.getpid(), runfiles.started(os.getpid()))
    assert me[1] == psutil.Process().create_time()
    assert runfiles.same_process(me)
    assert not runfiles.same_process((os.getpid(), me[1] - 1))


def test_a_full_disk_is_said_in_one_line(stopped, monkeypatch):
    """The run folder on a full file system (here a 64 KiB tmpfs, filled): nbdist's own
    error, not a raw OSError traceback, and nothing started."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    import tempfile

    disk = Path(tempfile.mkdtemp(prefix="full-"))  # short: the controller's socket paths fit
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]).returncode:
        disk.rmdir()
        pytest.skip("could not mount a tmpfs here")
    try:
        with contextlib.suppress(OSError):
            (disk / "filler").write_bytes(b"x" * (1 << 20))  # ENOSPC: the disk is full now
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(disk))
        magics, nothing_started = stopped
        with pytest.raises(ClusterError) as info:
            magics.distrain("start -n 2")
        assert str(info.value) == (
            "could not start 2 local engines: no space left on the disk that holds nbdist's run "
            f"files ({disk / 'nbdist'}). Free some space there, or set XDG_RUNTIME_DIR to a "
            "folder on another disk, then run %distrain start again."
        )
        nothing_started()
    finally:
        subprocess.run(["umount", str(disk)])
        disk.rmdir()


def test_a_kernel_folder_goes_when_its_kernel_is_gone_and_only_then(tmp_path):
    """The breakpoint socket's folder of a kernel killed outright (no exit handler ran) is
    removed by the next clean; this kernel's own stays."""
    made = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from nbdist.kernel.runfiles import "
            "kernel_folder; print(kernel_folder('bp', Path(sys.argv[1])))",
            str(tmp_path),
        ],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    theirs = Path(made.stdout.strip())
    mine = runfiles.kernel_folder("bp", tmp_path)
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    assert mine.name.startswith(f"nbdist-{os.getpid()}-") and mine.suffix == ".bp"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([theirs.name, mine.name])
    assert clean_stale(tmp_path) == 0  # no process was killed
    assert [p.name for p in tmp_path.iterdir()] == [mine.name]
    assert runfiles.remove_orphans(tmp_path, kernel=os.getpid()) == 0
    assert mine.exists()
