"""The CPUs a cgroup quota allows, read as the kernel reads them (/proc/self/cgroup and
mountinfo, then the quota files from the process's cgroup up to the hierarchy's root)."""

from __future__ import annotations

from pathlib import Path

from nbdist.engine.hardware import cpu_quota


def _proc(tmp: Path, cgroup: str, mountinfo: list[str]) -> str:
    proc = tmp / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(line + "\n" for line in mountinfo))
    return str(proc)


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("cpu_max", "cpu.max")).write_text(text)


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
