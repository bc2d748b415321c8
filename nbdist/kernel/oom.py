"""Was an engine killed by the kernel's out-of-memory killer? (local engines only)

A process killed by the OOM killer ends with SIGKILL, like ``kill -9``: its exit code cannot
tell them apart. Two places can: the kernel log names the PID it killed ("Killed process
12345 (python)"), when this user may read it (root, or ``kernel.dmesg_restrict=0``); and the
memory cgroup the engine ran in counts its OOM kills (``memory.events`` in cgroup v2,
``memory.oom_control`` in v1), which any user may read. :class:`MemoryWatch` notes each
engine's cgroup and count while the engine lives (at every job's start): the process's
``/proc`` entry is gone once it died.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
DMESG_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class _Seen:
    counter: Path | None  # the file that counts the cgroup's OOM kills
    kills: int  # its count then
    uptime: float  # seconds since boot then (the kernel log's clock)


class MemoryWatch:
    """Each watched engine's memory cgroup and its OOM-kill count, to compare after a death."""

    def __init__(self) -> None:
        self._seen: dict[int, _Seen] = {}
        self._counters: dict[str, Path | None] = {}  # /proc/PID/cgroup's text -> its counter

    def note(self, pids: Iterable[int]) -> None:
        """Note (again) where the running engines ``pids`` are, and their cgroups' OOM-kill
        counts; a gone PID is skipped. At every job's start, so cheap: each engine's cgroup is
        read again (a process may be moved to another), but the counter file of a cgroup is
        looked for once, and a count shared by several engines (one cgroup, as a rule) is read
        once."""
        now = _uptime()
        kills: dict[Path | None, int] = {}
        for pid in pids:
            try:
                where = Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                continue  # already gone: keep what was seen while it ran
            if where not in self._counters:
                self._counters[where] = _counter_of(where)
            counter = self._counters[where]
            if counter is None and pid in self._seen:
                continue
            if counter not in kills:
                kills[counter] = _oom_kills(counter)
            self._seen[pid] = _Seen(counter, kills[counter], now)

    def cause(self, pid: int) -> str:
        """Why ``pid`` (killed by SIGKILL) died, when the kernel says it was out of memory;
        "" when nothing says so."""
        seen = self._seen.get(pid)
        since = seen.uptime - 1.0 if seen is not None else 0.0
        line = kernel_log_kill(pid, since)
        limit = _limit_text(seen.counter) if seen is not None else ""
        if line is not None:
            return f"the kernel's out-of-memory killer{limit} (kernel log: {line})"
        if seen is not None and seen.counter is not None:
            kills = _oom_kills(seen.counter)
            if kills > seen.kills:
                return (
                    f"the kernel's out-of-memory killer{limit} (the OOM-kill count of its "
                    f"memory cgroup {_cgroup_name(seen.counter)} rose from {seen.kills} to "
                    f"{kills})"
                )
        return ""


def memory_counter(pid: int) -> Path | None:
    """The file counting OOM kills in the memory cgroup of ``pid`` (None: not found)."""
    try:
        return _counter_of(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None


def _counter_of(cgroup_text: str) -> Path | None:
    """The OOM-kill counter of the memory cgroup a ``/proc/PID/cgroup`` text names."""
    lines = cgroup_text.splitlines()
    for line in lines:  # "4:memory:/a/b" (v1), "0::/a/b" (v2)
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            found = CGROUP_ROOT / "memory" / path.lstrip("/") / "memory.oom_control"
            if found.exists():
                return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                found = root / path.lstrip("/") / "memory.events"
                if found.exists():
                    return found
    return None


def _oom_kills(counter: Path | None) -> int:
    if counter is None:
        return 0
    try:
        text = counter.read_text()
    except OSError:
        return 0
    match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def _limit_text(counter: Path | None) -> str:
    """`` (memory limit 256 MiB)`` of the cgroup, "" when it has none."""
    if counter is None:
        return ""
    name = "memory.limit_in_bytes" if counter.name == "memory.oom_control" else "memory.max"
    try:
        raw = (counter.parent / name).read_text().strip()
        limit = int(raw)
    except (OSError, ValueError):  # "max": no limit
        return ""
    if limit >= 1 << 60:
        return ""
    return f" (memory limit {limit / 2**20:.0f} MiB)"


def _cgroup_name(counter: Path) -> str:
    parts = counter.parent.relative_to(CGROUP_ROOT).parts
    return "/" + "/".join(parts[1:] if parts and parts[0] in ("memory", "unified") else parts)


def kernel_log_kill(pid: int, since: float) -> str | None:
    """The kernel log's line saying it killed ``pid`` after ``since`` (seconds since boot);
    None when there is none or the log cannot be read."""
    dmesg = shutil.which("dmesg")
    if dmesg is None:
        return None
    try:
        out = subprocess.run(
            [dmesg], capture_output=True, text=True, timeout=DMESG_TIMEOUT_S, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    pattern = re.compile(rf"^\[\s*([\d.]+)\]\s*(.*Killed process {pid} \(.*)$")
    for line in reversed(out.splitlines()):
        match = pattern.match(line)
        if match and float(match.group(1)) >= since:
            return match.group(2).split(" total-vm")[0].split(", ")[0]
    return None


def _uptime() -> float:
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
