"""nbdist's run files: where they live, and how they are read back without trusting anybody else.

Each local cluster has one *run record*, ``nbdist-<kernel pid>-<random>.pids``, in a per-user
directory made 0700 (:func:`run_dir`). It names the owning kernel and every process the cluster
started, each as ``(pid, start)``: a PID alone may name an unrelated process after the original
exited (PID reuse, or a reboot with a persistent temp directory). ``start`` is when the process
began in seconds since boot, from the kernel's own tick count (:func:`started`), and the record
holds this boot's id: a wall-clock create time (psutil's) moves when the clock is set (NTP), and
the same process then read as another one. The reaper (:mod:`nbdist.kernel.reaper`) and
:func:`clean_stale` kill a listed process only when its start still matches, and read a record
only when this user owns it and nobody else can write it.

A record is rewritten (atomically: ``mkstemp`` + ``os.replace``) as soon as each process exists:
the network-namespace holder, the controller, each engine at launch (also while engines are
replaced), so a kernel killed at any moment of a start leaves nothing running. Beside each
record, ``<record>.ipc/`` (0700) holds the controller's sockets; it goes with the record.
Folders a kernel keeps for itself (the breakpoint socket's) are named and owned the same way
(:func:`kernel_folder`), and go when their kernel is gone.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nbdist.engine.netns import proc_stat
from nbdist.errors import ClusterError

log = logging.getLogger(__name__)

# A process's start is a count of clock ticks (10 ms): equal for one process across reads; a
# different process with the same PID differs by at least a tick. (The name is older than
# that: it was a slack on psutil's create times.)
CREATE_TIME_SLACK_S = 0.005
MAX_RECORD_BYTES = 1 << 16
STOP_GRACE_S = 3.0  # for a stopped cluster's processes to exit before they are killed

Proc = tuple[int, float]

# A unix socket's path has at most 107 bytes (sun_path, with its NUL). The controller's longest
# lies beside the run record: <folder>/nbdist-<pid up to 4194304>-<8 random>.ipc/s:<port>. A
# deeper folder made the controller exit at its first bind ("exited while starting").
SOCKET_PATH_MAX = 107


def socket_path_max(platform: str | None = None) -> int:
    """The longest unix socket path ``platform`` (this one by default) takes: 107 bytes on
    Linux, 103 on macOS and the BSDs (their sun_path has 104 bytes, with its NUL)."""
    return SOCKET_PATH_MAX if (platform or sys.platform).startswith("linux") else 103


def longest_socket_path(folder: Path) -> int:
    """Bytes in the longest controller socket path a cluster with run files in ``folder`` uses."""
    return len(os.fsencode(folder / "nbdist-4194304-abcdefgh.ipc" / "s:65535"))


def private_dir(path: Path) -> Path:
    """``path`` as a directory this user owns that nobody else can enter (made 0700 if missing)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory owned by uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def run_dir_candidates() -> list[Path]:
    """Where run files may go, best first: ``$XDG_RUNTIME_DIR`` (per user, cleared at logout),
    Jupyter's runtime directory (in the home directory), then a per-uid folder in the temp dir."""
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        out.append(Path(xdg) / "nbdist")
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        out.append(Path(jupyter_runtime_dir()) / "nbdist")
    except ImportError:
        pass
    out.append(Path(tempfile.gettempdir()) / f"nbdist-{os.getuid()}")
    return out


def run_dir() -> Path:
    """The first candidate directory that is (or could be made) private to this user and is
    short enough for the controller's socket paths."""
    reasons = []
    for path in run_dir_candidates():
        length = longest_socket_path(path)
        if length > socket_path_max():
            reasons.append(
                f"{path}: too deep for the controller's sockets ({length} bytes, at most "
                f"{socket_path_max()})"
            )
            continue
        try:
            return private_dir(path)
        except OSError as e:
            reasons.append(f"{path}: {e}")
    raise ClusterError(
        "nbdist found no private folder for its run files ("
        + "; ".join(reasons)
        + "). Set XDG_RUNTIME_DIR to a short folder only you can write, then %distrain start "
        "again."
    )


def _stat(pid: int) -> tuple[str, float] | None:
    """Process ``pid``'s state letter and start (seconds since boot), or None if there is none.
    Linux: ``/proc/PID/stat`` (:func:`nbdist.engine.netns.proc_stat`). Elsewhere psutil's
    create time, in wall-clock seconds, stands in."""
    if not _HAS_PROC:
        return _psutil_stat(pid)
    stat_ = proc_stat(pid)
    return None if stat_ is None else (stat_[0], stat_[1] / _CLOCK_TICKS)


def _psutil_stat(pid: int) -> tuple[str, float] | None:
    import psutil

    try:
        p = psutil.Process(pid)
        return ("Z" if p.status() == psutil.STATUS_ZOMBIE else "R"), p.create_time()
    except psutil.Error:
        return None


_HAS_PROC = os.path.isdir("/proc/self")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def started(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since boot (None: no such process). Never
    changes for a process, whatever the clock does (on Linux; elsewhere psutil's create time,
    in wall-clock seconds, which does)."""
    stat_ = _stat(pid)
    return None if stat_ is None else stat_[1]


def boot_id() -> str:
    """This boot's id (Linux; "" elsewhere): a record of another boot names no process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def same_process(proc: Proc) -> bool:
    """Whether the process ``(pid, start)`` still runs (a zombie counts as gone)."""
    pid, start = proc
    stat_ = _stat(pid)
    return stat_ is not None and abs(stat_[1] - start) <= CREATE_TIME_SLACK_S and stat_[0] != "Z"


def tree_of(*procs: Proc) -> list:
    """What is left of the processes ``procs`` (psutil processes): each one if it still runs,
    its descendants, and the processes still in the session it leads. ipyparallel starts each
    controller and engine in a session of its own; a controller stopped while it starts exits
    before its scheduler children, which then belong to no parent but stay in that session."""
    import psutil

    out = {}
    for proc in procs:
        if same_process(proc):
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(proc[0])
                out.update({p.pid: p for p in (root, *root.children(recursive=True))})
    # The sessions led by a recorded process: still its session while that process runs (or
    # is a zombie), or while no process has its PID (orphans in the session keep the PID from
    # being given out again). A PID held by another process now leads that process's session:
    # another cluster's controller or engine, say, once PIDs wrapped.
    leaders = {}
    for pid, start in procs:
        now = started(pid)
        if now is None or abs(now - start) <= CREATE_TIME_SLACK_S:
            leaders[pid] = start
    for p in psutil.process_iter():  # one pass for all of them
        with contextlib.suppress(psutil.Error, OSError):
            # A session's id is its leader's PID; born after the leader: not an older process.
            leader = leaders.get(os.getsid(p.pid))
            if leader is None:
                continue
            born = started(p.pid)
            if born is not None and born >= leader - CREATE_TIME_SLACK_S:
                out.setdefault(p.pid, p)
    return [p for p in out.values() if _running(p)]


def _running(p: Any) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE  # exited, its parent has not reaped it yet
    except psutil.Error:
        return False


def kill_tree(proc: Proc) -> bool:
    """SIGKILL what is left of a recorded process (:func:`tree_of`); whether anything was."""
    import psutil

    procs = tree_of(proc)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return bool(procs)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (mode 0600) in one step; no predictable temporary name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_trusted(path: str | Path) -> str | None:
    """The file's text when this user owns it and neither group nor others may write it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            log.warning("ignoring %s: not a private file of uid %d", path, os.getuid())
            return None
        return os.read(fd, MAX_RECORD_BYTES).decode()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def record_jobs(text: str) -> tuple[list[str], str | None]:
    """The Slurm jobs a record names, and the folder of theirs to remove (none in a record of
    a version that wrote none)."""
    try:
        data = json.loads(text)
        jobs, folder = data.get("jobs", []), data.get("folder")
    except (ValueError, AttributeError):
        return [], None
    jobs = [str(j) for j in jobs if str(j).isdigit()] if isinstance(jobs, list) else []
    return jobs, folder if isinstance(folder, str) and os.path.isabs(folder) else None


def parse_record(text: str) -> tuple[Proc, list[Proc]] | None:
    """The kernel and the processes of a record; None if it cannot be read. A record of an
    earlier boot names a kernel that is gone and no process that can still run.

    The processes are under ``"started"``: records of nbdist versions that wrote wall-clock
    create times under ``"procs"`` are not read here (their times compare with nothing this
    version measures), and those versions do not read these (no ``"procs"``): a kernel still
    running an older nbdist keeps its cluster, and its record, whatever this one reads.
    """
    try:
        data = json.loads(text)
        kernel = (int(data["kernel"][0]), float(data["kernel"][1]))
        procs = [(int(p), float(t)) for p, t in data["started"]]
        boot = str(data["boot"])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    if boot != boot_id():
        return (kernel[0], -1.0), []
    return kernel, procs


class RunRecord:
    """This kernel's run record for one local cluster (see the module docstring)."""

    def __init__(self, directory: Path | None = None) -> None:
        folder = directory or run_dir()
        pid = os.getpid()
        self.kernel: Proc = (pid, started(pid) or 0.0)
        self.boot = boot_id()
        fd, name = tempfile.mkstemp(prefix=f"nbdist-{pid}-", suffix=".pids", dir=folder)
        os.close(fd)
        self.path = Path(name)
        self.procs: list[Proc] = []
        self.jobs: list[str] = []
        self.folder: str | None = None  # a folder of the cluster's own, removed with it
        self.write([])

    def write(
        self,
        pids: Iterable[int | None],
        *,
        jobs: Iterable[str] | None = None,
        folder: str | None = None,
    ) -> None:
        """Record exactly ``pids`` (those still running) as the cluster's processes, and
        ``jobs``, the batch jobs (Slurm's) to cancel with them, and ``folder``, where their
        files are (each unchanged when None).

        A PID recorded before keeps the start it was recorded with, and is dropped when
        that process is gone: a dead engine's PID, reused by another process (PIDs wrap at
        32768 here), must never become that process's record — a stop kills what it records.
        """
        known = dict(self.procs)
        procs = []
        for pid in pids:
            if not pid:
                continue
            if pid in known:
                if same_process((pid, known[pid])):
                    procs.append((pid, known[pid]))
                continue
            start = started(pid)
            if start is not None:
                procs.append((pid, start))
        self.procs = procs
        if jobs is not None:
            self.jobs = [str(j) for j in jobs]
        self.folder = folder or self.folder
        record = {"kernel": self.kernel, "boot": self.boot, "started": procs, "jobs": self.jobs}
        if self.folder:
            record["folder"] = self.folder
        write_atomic(self.path, json.dumps(record))

    @property
    def sockets(self) -> Path:
        """The folder for this cluster's controller sockets, named after the record."""
        return sockets_of(self.path)

    @property
    def profile(self) -> Path:
        """The cluster's ipyparallel profile folder, named after the record: its connection
        files and the controller's and engines' logs (the engines' raw output: what a cell
        writes to file descriptors 1 and 2, a C library's messages)."""
        return profile_of(self.path)

    def remove(self) -> None:
        """The record goes, and with it the profile folder and its logs unless they are to be
        kept (``NBDIST_KEEP_LOGS=1``)."""
        if not keep_logs():
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(self.profile).st_mode):
                    shutil.rmtree(self.profile)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class Reaper:
    """A cluster's run record and the reaper process that watches it (:mod:`.reaper`), started
    in its own session so that the kernel's death does not take it along."""

    def __init__(self, folder: Path) -> None:
        self.record = RunRecord(folder)
        self.process = subprocess.Popen(
            # Not -m: the notebook's folder first on sys.path could hide a standard module.
            [
                sys.executable,
                "-c",
                "import sys; sys.path.pop(0); from nbdist.kernel.reaper import watch; "
                "watch(sys.argv[1])",
                str(self.record.path),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Remove the record (the cluster is stopped): the reaper sees it go and exits.

        What is left of the recorded processes after ``grace_s`` is killed first: ipyparallel
        signals its controller and kills it later from an event loop that may be gone by then
        (a stop during a background start, at the kernel's exit, left a controller that was
        still starting behind, or its scheduler children).
        """
        import psutil

        deadline = time.monotonic() + grace_s
        while (left := tree_of(*self.record.procs)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil refuses a PID that now names another process
        if left:
            log.info("killed %d cluster process(es) that outlived the stop", len(left))
        self.record.remove()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def sockets_of(record: str | Path) -> Path:
    return Path(record).with_suffix(".ipc")


def profile_of(record: str | Path) -> Path:
    return Path(record).with_suffix(".profile")


def keep_logs() -> bool:
    """Whether a stopped cluster's logs stay (``NBDIST_KEEP_LOGS=1``) instead of going."""
    return os.environ.get(KEEP_LOGS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


KEEP_LOGS_ENV = "NBDIST_KEEP_LOGS"


def remove_record(record: str | Path, *, logs: bool = True) -> None:
    """Delete a record, its sockets folder and (with ``logs``) its profile folder, each only a
    real folder, not a link to one."""
    folders = [sockets_of(record), *([profile_of(record)] if logs else [])]
    for folder in folders:
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(folder).st_mode):
                shutil.rmtree(folder)
    with contextlib.suppress(OSError):
        os.unlink(record)


def kernel_folder(kind: str, directory: Path | None = None) -> Path:
    """A private folder of this kernel's own, ``nbdist-<pid>-<random>.<kind>`` in the run
    directory, with an ``owner`` file naming the kernel as a record does: when the kernel dies
    without removing it (``kill -9``, or SIGTERM, which runs no exit handler), the reaper or the
    next :func:`clean_stale` does (:func:`remove_orphans`)."""
    folder = Path(
        tempfile.mkdtemp(
            prefix=f"nbdist-{os.getpid()}-", suffix=f".{kind}", dir=directory or run_dir()
        )
    )
    pid = os.getpid()
    owner = {"kernel": (pid, started(pid) or 0.0), "boot": boot_id(), "started": []}
    write_atomic(folder / "owner", json.dumps(owner))
    return folder


KERNEL_FOLDERS = ("bp",)  # the kinds of kernel folder (kernel/breakpoints.py's socket)


def remove_orphans(directory: str | Path, *, kernel: int | None = None) -> int:
    """Remove the kernel folders in ``directory`` whose kernel is gone (only those of the
    kernel with PID ``kernel``, when given); returns how many."""
    removed = 0
    for kind in KERNEL_FOLDERS:
        pattern = f"nbdist-{kernel if kernel is not None else '*'}-*.{kind}"
        for path in glob.glob(os.path.join(directory, pattern)):
            text = read_trusted(os.path.join(path, "owner"))
            record = parse_record(text) if text is not None else None
            if record is None or same_process(record[0]):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def clean_stale(directory: str | Path | None = None) -> int:
    """Kill the cluster processes of kernels that died without stopping them; returns how many.

    The reaper normally does this; this catches what it could not (say the reaper was killed
    too). Only records this user owns and only processes whose start time still matches are
    acted on; a record that cannot be read is skipped, never fatal.
    """
    folder = Path(directory) if directory is not None else run_dir()
    killed = 0
    for path in glob.glob(os.path.join(folder, "nbdist-*-*.pids")):
        text = read_trusted(path)
        record = parse_record(text) if text is not None else None
        if record is None:
            continue
        kernel, procs = record
        if same_process(kernel):
            continue
        killed += sum(kill_tree(proc) for proc in procs)
        remove_record(path, logs=not keep_logs())
    remove_orphans(folder)
    return killed
