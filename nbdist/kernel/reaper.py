"""Kills the cluster's processes when the kernel that owns them dies without stopping them.

A kernel that is killed outright (nbval and Jupyter's forced restarts send SIGKILL) runs no
atexit handler, and its controller and engines would keep running, holding memory and GPUs. The
reaper is a small child process started with the cluster, in its own session so the kernel's
death does not take it along. It watches the kernel, by PID *and* start time (a recycled PID is
not the kernel); when the kernel is gone it kills the process trees listed in the run record
(:mod:`nbdist.kernel.runfiles`), each only if its start time still matches, and cancels the
Slurm jobs it lists (``scancel``: an allocation left running would burn the user's hours), and
removes their folder and the kernel's own folders (the breakpoint socket's). When
the cluster is stopped normally the record is removed and the reaper exits.

    python -m nbdist.kernel.reaper RECORD   (nbdist starts it with -c, see runfiles.Reaper)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from nbdist.kernel.runfiles import (
    keep_logs,
    kill_tree,
    parse_record,
    read_trusted,
    record_jobs,
    remove_orphans,
    remove_record,
    same_process,
)

POLL_S = 0.5


def watch(record: str) -> None:
    while os.path.exists(record):
        text = read_trusted(record)
        parsed = parse_record(text) if text is not None else None
        if text is not None and parsed is not None:
            kernel, procs = parsed
            if not same_process(kernel):
                for proc in procs:
                    kill_tree(proc)
                jobs, folder = record_jobs(text)
                cancel_jobs(jobs)
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
                remove_record(record, logs=not keep_logs())
                remove_orphans(os.path.dirname(record), kernel=kernel[0])
                return
        time.sleep(POLL_S)


def cancel_jobs(jobs: list[str]) -> None:
    """``scancel`` each job (Slurm's own command: it cancels only this user's jobs)."""
    for job in jobs:
        try:
            subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass


if __name__ == "__main__":
    watch(sys.argv[1])
