"""What hardware a process can see, without importing a framework."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess


def visible_gpus() -> list[str]:
    """CUDA device ids this process may use, as strings (``[]`` on a CPU-only machine).

    ``CUDA_VISIBLE_DEVICES`` wins when set (an empty value hides every GPU); otherwise the GPUs
    that ``nvidia-smi -L`` lists. Asking torch would import it (seconds), and would initialise
    CUDA before each engine is pinned to its own device.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def engine_info() -> dict[str, object]:
    """Identity and hardware of the engine this runs in; gathered once per engine."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "gpus": visible_gpus(),
        "cpus": usable_cpus(),
    }
