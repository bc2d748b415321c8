"""What hardware a process can see, without importing a framework."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

from nbdist.protocol import EngineReport, SlurmTask


def visible_gpus() -> list[str]:
    """CUDA device ids this process may use, as strings (``[]`` on a CPU-only machine).

    ``CUDA_VISIBLE_DEVICES`` wins when set (an empty value hides every GPU); otherwise the GPUs
    that ``nvidia-smi -L`` lists. Asking torch would import it (seconds), and would initialise
    CUDA before each engine is pinned to its own device.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return parse_visible_devices(env)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return listed_gpus(out.stdout)


def parse_visible_devices(value: str) -> list[str]:
    """The device ids a ``CUDA_VISIBLE_DEVICES`` value makes visible, in its order.

    As CUDA reads it: indices or ``GPU-``/``MIG-`` UUIDs separated by commas; an invalid entry
    (``-1``, an empty one) hides itself and every device after it.
    """
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def listed_gpus(nvidia_smi_l: str) -> list[str]:
    """Device indices, as strings, from the output of ``nvidia-smi -L`` (one ``GPU n: ...`` line
    per GPU; its MIG instances, indented below, are not separate devices here)."""
    gpus = [line for line in nvidia_smi_l.splitlines() if line.startswith("GPU ")]
    return [str(i) for i in range(len(gpus))]


GPU_QUERY = ["--query-gpu=index,uuid", "--format=csv,noheader,nounits"]
APPS_QUERY = ["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]


def parse_gpu_holders(gpus_csv: str, apps_csv: str) -> dict[str, list[tuple[int, int | None]]]:
    """``nvidia-smi`` CSV output → {GPU index: [(pid, MiB or None), ...]} of the processes
    holding memory on each GPU (MiB is None where nvidia-smi says ``[N/A]``)."""
    index_of = {}
    for line in gpus_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            index_of[parts[1]] = parts[0]
    holders: dict[str, list[tuple[int, int | None]]] = {}
    for line in apps_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or parts[0] not in index_of or not parts[1].isdigit():
            continue
        mib = int(parts[2]) if parts[2].isdigit() else None
        holders.setdefault(index_of[parts[0]], []).append((int(parts[1]), mib))
    return holders


def gpu_holders() -> dict[str, list[tuple[int, int | None]]]:
    """Processes already holding memory on each GPU, from ``nvidia-smi`` ({} without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        gpus, apps = (
            subprocess.run([smi, *q], capture_output=True, text=True, timeout=10, check=True).stdout
            for q in (GPU_QUERY, APPS_QUERY)
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_gpu_holders(gpus, apps)


INFO_QUERY = [
    "--query-gpu=index,uuid,name,memory.used,memory.total",
    "--format=csv,noheader,nounits",
]


def parse_gpu_info(info_csv: str, ids: list[str]) -> list[dict[str, object]]:
    """``nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total`` CSV → one dict per
    GPU of ``ids`` (indices or UUIDs, as ``CUDA_VISIBLE_DEVICES`` names them), in their order:
    ``{"id", "name", "used_mib", "total_mib"}``; MiB are None where nvidia-smi says ``[N/A]``."""
    rows = {}
    for line in info_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5 or not parts[0].isdigit():
            continue
        index, uuid, name, used, total = parts
        row: dict[str, object] = {
            "id": index,
            "name": name,
            "used_mib": int(used) if used.isdigit() else None,
            "total_mib": int(total) if total.isdigit() else None,
        }
        rows[index] = rows[uuid] = row
    return [rows[i] for i in ids if i in rows]


def gpu_info(ids: list[str]) -> list[dict[str, object]]:
    """Name and memory in use (by every process) of the GPUs ``ids``, from ``nvidia-smi``, which
    sees every GPU whatever ``CUDA_VISIBLE_DEVICES`` says; ``[]`` without it. (nvidia-smi numbers
    GPUs in PCI bus order; CUDA does too with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and by default
    only where all GPUs are the same model.)"""
    smi = shutil.which("nvidia-smi")
    if smi is None or not ids:
        return []
    try:
        out = subprocess.run(
            [smi, *INFO_QUERY], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_gpu_info(out, ids)


def busy_gpus_notice(
    visible: list[str], holders: dict[str, list[tuple[int, int | None]]], *, me: int
) -> str | None:
    """One line for the start notice when a visible GPU already has memory held on it."""
    parts = []
    for gpu in visible:
        procs = holders.get(gpu)
        if not procs:
            continue
        known = [m for _, m in procs if m is not None]
        size = f"{sum(known):,} MiB" if known else "memory"
        who = ", ".join(f"{pid} (this kernel)" if pid == me else str(pid) for pid, _ in procs)
        parts.append(f"GPU {gpu}: {size} held by pid{'s' if len(procs) > 1 else ''} {who}")
    if not parts:
        return None
    return (
        "nbdist: another process already uses a GPU the workers will use ("
        + "; ".join(parts)
        + "): they share its memory and compute. Set CUDA_VISIBLE_DEVICES to choose others."
    )


def affinity_cpus() -> int:
    """CPUs this process may be scheduled on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, and fewer where a CPU quota of its cgroup
    (a JupyterHub spawner's ``cpu_limit``, a container's ``--cpus``) allows less time than that,
    rounded down (at least 1)."""
    return cpus_within(affinity_cpus(), cpu_quota())


def cpus_within(affinity: int, quota: float | None) -> int:
    """The CPUs an affinity mask of ``affinity`` CPUs and a CPU quota (None: none) allow."""
    return affinity if quota is None else max(1, min(affinity, int(quota)))


def cpu_quota(proc: str = "/proc/self") -> float | None:
    """The CPUs' worth of time this process's cgroups allow (quota / period, the smallest along
    the path from its cgroup to the hierarchy's root, cgroup v2's ``cpu.max`` or v1's
    ``cpu.cfs_quota_us``), None without a limit or where there are no cgroups to read."""
    limits = _along(proc, "cpu", _quota_in)
    return min(limits) if limits else None


def memory_room(proc: str = "/proc/self") -> tuple[int, int] | None:
    """The tightest memory limit of this process's cgroups (cgroup v2's ``memory.max``, v1's
    ``memory.limit_in_bytes``, from its cgroup up: a JupyterHub spawner's ``mem_limit``) and
    what that cgroup uses now, in bytes; None without a limit."""
    found = _along(proc, "memory", _memory_in)
    return min(found, key=lambda room: room[0] - room[1]) if found else None


def _along(proc: str, controller: str, read: Any) -> list[Any]:
    """``read(folder, v2=...)`` for the cgroup of ``controller`` the process ``proc`` (a
    /proc folder) is in and each of its ancestors up to the hierarchy's root: the values read
    (None is no value); nothing where there are no cgroups to read."""
    try:
        with open(f"{proc}/cgroup") as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f]
        with open(f"{proc}/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    out = []
    for entry in memberships:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        v2 = not controllers  # "0::/path": the unified hierarchy
        if not v2 and controller not in controllers.split(","):
            continue
        for root, mount in _cgroup_mounts(mounts, v2=v2, wanted=controller):
            out += _values_along(mount, root, path, read, v2=v2)
    return out


def _cgroup_mounts(mounts: list[list[str]], *, v2: bool, wanted: str) -> list[tuple[str, str]]:
    """(the cgroup path mounted, where) for each cgroup2 mount, or each v1 mount of ``wanted``'s
    controller, from /proc/self/mountinfo (fields: ... root mountpoint ... - fstype source opts)."""
    out = []
    for fields in mounts:
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        if fstype == ("cgroup2" if v2 else "cgroup") and (v2 or wanted in options.split(",")):
            out.append((fields[3], fields[4]))
    return out


def _values_along(mount: str, root: str, path: str, read: Any, *, v2: bool) -> list[Any]:
    """What ``read`` finds in the cgroup at ``path`` and its ancestors up to the mount's root."""
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")) :] or "/"  # a container's namespace: its own root
    here = os.path.join(mount, path.lstrip("/"))
    out = []
    while True:
        value = read(here, v2=v2)
        if value is not None:
            out.append(value)
        if os.path.normpath(here) == os.path.normpath(mount):
            return out
        here = os.path.dirname(here)


_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _memory_in(folder: str, *, v2: bool) -> tuple[int, int] | None:
    """(the limit, what is in use) of one memory cgroup; in use: its working set, as kubelet
    and docker count it (the usage less the inactive file cache, which the kernel reclaims
    before it kills anything: a file read once must not refuse a start)."""
    limit_file, used_file, inactive = ("memory.max", "memory.current", "inactive_file") if v2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")  # fmt: skip
    try:
        with open(os.path.join(folder, limit_file)) as f:
            text = f.read().strip()
        if text == "max" or int(text) >= _NO_LIMIT:
            return None
        with open(os.path.join(folder, used_file)) as f:
            used = int(f.read())
    except (OSError, ValueError):
        return None
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = dict(line.split() for line in f if len(line.split()) == 2)
        used -= int(stat.get(inactive, 0))
    except (OSError, ValueError):
        pass
    return int(text), max(0, used)


def _quota_in(folder: str, *, v2: bool) -> float | None:
    try:
        if v2:
            with open(os.path.join(folder, "cpu.max")) as f:
                quota_text, period_text = f.read().split()
            if quota_text == "max":
                return None
            quota, period = int(quota_text), int(period_text)
        else:
            with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                quota = int(f.read())
            with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                period = int(f.read())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


ADDRESS_ENV = "NBDIST_ADDRESS"


def reachable_address(peer: str) -> str:
    """The address other hosts reach this process at: ``$NBDIST_ADDRESS`` when set (a host with
    several interfaces, or a test that gives engines on one machine different loopback
    addresses), else the local address of the interface this host uses to reach ``peer`` (the
    controller). A UDP "connect" picks the route without sending anything."""
    env = os.environ.get(ADDRESS_ENV, "").strip()
    if env:
        return env
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address or ``localhost``) is this host's loopback."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def interface_of(address: str) -> str | None:
    """Name of the network interface holding ``address`` (for ``GLOO_SOCKET_IFNAME``)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def process_info(address: str | None) -> EngineReport:
    """Identity and hardware of this process, and ``address``, the one other hosts reach it at
    (None when not known)."""
    return EngineReport(
        host=socket.gethostname(),
        pid=os.getpid(),
        gpus=visible_gpus(),
        cpus=usable_cpus(),
        address=address,
        addresses=host_addresses(),
        interfaces=interfaces(),
        slurm=slurm_task(),
    )


def slurm_task(env: Mapping[str, str] = os.environ) -> SlurmTask | None:
    """The Slurm task this process is (``srun`` set ``SLURM_PROCID`` and the rest), else None.
    A batch script's own shell has no ``SLURM_PROCID``: only a step's tasks count."""
    try:
        return SlurmTask(
            job=env["SLURM_JOB_ID"],
            procid=int(env["SLURM_PROCID"]),
            node=int(env["SLURM_NODEID"]),
            local=int(env["SLURM_LOCALID"]),
            nodename=env.get("SLURMD_NODENAME", ""),
        )
    except (KeyError, ValueError):
        return None


def interfaces() -> dict[str, str]:
    """This host's IPv4 addresses and the interface each is on (what GLOO_SOCKET_IFNAME names)."""
    import psutil

    return {
        a.address: name
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET
    }


def host_addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses (a fallback when the route says loopback)."""
    import psutil

    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                out.append(a.address)
    return out
