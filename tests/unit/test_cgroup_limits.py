"""The CPUs and memory a cgroup allows, read as the kernel reads them (/proc/self/cgroup and
mountinfo, then the cgroup's files from the process's cgroup up to the hierarchy's root), and
the start refused when the memory left is too little for the workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbdist.engine.hardware import cpu_quota, memory_room
from nbdist.errors import ClusterError
from nbdist.kernel.local import too_little_memory


def _proc(tmp: Path, cgroup: str, mountinfo: list[str]) -> str:
    proc = tmp / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(line + "\n" for line in mountinfo))
    return str(proc)


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        name = {"cpu_max": "cpu.max", "memory_max": "memory.max", "memory_stat": "memory.stat",
                "memory_current": "memory.current"}.get(name, name)  # fmt: skip
        (folder / name).write_text(text)


def test_cgroup_v2_the_smallest_quota_on_the_way_up(tmp_path):
    fs = tmp_path / "cg2"
    _write(fs, cpu_max="max 100000\n")
    _write(fs / "user.slice", cpu_max="400000 100000\n")
    _write(fs / "user.slice" / "jupyter-ann.scope", cpu_max="150000 100000\n")  # cpu_limit=1.5
    proc = _proc(
        tmp_path,
        "0::/user.slice/jupyter-ann.scope\n",
        [f"35 24 0:30 / {fs} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"],
    )
    assert cpu_quota(proc) == 1.5


def test_cgroup_v1_cfs_quota_and_no_limit(tmp_path):
    fs = tmp_path / "cpu"
    _write(fs, **{"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    _write(fs / "kids", **{"cpu.cfs_quota_us": "200000\n", "cpu.cfs_period_us": "100000\n"})
    mounts = [f"40 30 0:35 / {fs} rw - cgroup cgroup rw,cpu,cpuacct"]
    assert cpu_quota(_proc(tmp_path / "a", "4:cpu,cpuacct:/kids\n", mounts)) == 2.0
    assert cpu_quota(_proc(tmp_path / "b", "4:cpu,cpuacct:/\n", mounts)) is None


def test_a_containers_cgroup_namespace_its_own_root(tmp_path):
    """In a container the mount's root is the container's cgroup: /proc/self/cgroup may name
    the host's path, or / within the namespace."""
    fs = tmp_path / "cg2"
    _write(fs, cpu_max="50000 100000\n")  # docker run --cpus 0.5
    mounts = [f"35 24 0:30 /docker/abc {fs} ro - cgroup2 cgroup2 rw"]
    assert cpu_quota(_proc(tmp_path / "a", "0::/docker/abc\n", mounts)) == 0.5
    assert cpu_quota(_proc(tmp_path / "b", "0::/\n", mounts)) == 0.5


def test_no_cgroups_to_read(tmp_path):
    assert cpu_quota(str(tmp_path / "nowhere")) is None


def test_cgroup_v2_memory_the_tightest_room_and_the_cache_not_counted(tmp_path):
    fs = tmp_path / "cg2"
    _write(fs, memory_max="max\n")
    _write(fs / "user.slice", memory_max=f"{8 << 30}\n", memory_current=f"{6 << 30}\n",
           memory_stat=f"anon {1 << 30}\ninactive_file {5 << 30}\n")  # fmt: skip
    _write(
        fs / "user.slice" / "ann",
        memory_max=f"{2 << 30}\n",
        memory_current=f"{1 << 30}\n",
        memory_stat=f"anon {600 << 20}\ninactive_file {400 << 20}\n",
    )  # mem_limit = 2G; fmt: skip
    proc = _proc(tmp_path, "0::/user.slice/ann\n", [f"35 24 0:30 / {fs} rw - cgroup2 cgroup2 rw"])
    # ann's: 2 GB, 1 GB in use of which 400 MB is file cache (room 1.4 GB); user.slice's:
    # 8 GB, 6 GB in use of which 5 GB is cache (room 7 GB). The tighter one is ann's.
    assert memory_room(proc) == (2 << 30, (1 << 30) - (400 << 20))


def test_cgroup_v1_memory_no_limit_is_none(tmp_path):
    fs = tmp_path / "memory"
    _write(fs, **{"memory.limit_in_bytes": "9223372036854771712\n",
                  "memory.usage_in_bytes": "123\n"})  # fmt: skip
    mounts = [f"40 30 0:36 / {fs} rw - cgroup cgroup rw,memory"]
    assert memory_room(_proc(tmp_path, "5:memory:/\n", mounts)) is None


def test_too_little_memory_says_how_many_fit_and_nothing_when_they_fit():
    gb = 1 << 30
    with pytest.raises(ClusterError) as refused:
        too_little_memory(4, "torch", room=(2 * gb, gb))  # 1 GB left: 3 torch workers fit
    assert "4 workers need about 1.3 GB of memory (325 MB each" in str(refused.value)
    assert "leaves 1.0 GB (its cgroup allows 2.0 GB, 1.0 GB in use): fewer workers (-n 3)." in (
        str(refused.value)
    )
    with pytest.raises(ClusterError, match=r"leaves 200 MB .*: no worker fits\."):
        too_little_memory(1, "tf", room=(gb, gb - (200 << 20)))  # a TensorFlow engine: 596 MB
    too_little_memory(3, "torch", room=(2 * gb, gb))  # 975 MB of 1 GB: fits, nothing said
