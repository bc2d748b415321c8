"""A third framework, registered from a package of its own (an ``nbdist.backends`` entry
point), runs a cell, is exported and is refused a healing through the backend interface alone:
nbdist's kernel side has no framework's name outside the registry."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster]

TOY = Path(__file__).parent / "toy"

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    ip.run_line_magic("distrain", "start -n 2")

    def cell(name, line, source):
        print(f"=== {name}", flush=True)
        ip.run_cell(f"%%distrain {line}\\n{source}")
        sys.stdout.flush()

    cell("profile", "--profile --framework toy", "pass")
    # No --framework: the cell's names say which one it is for.
    cell("first", "", "r, w = toy\\nprint(f'rank {r} of {w}')\\ntotal = 10 * r\\n"
         "log(step=0, loss=float(w - r))")
    cell("second", "", "print('total', total, toy)")
    print("=== export", flush=True)
    ip.run_line_magic("distrain", f"export {sys.argv[1]}")
    cluster = ip.magics_manager.registry["DistrainMagics"].cluster
    print("=== pid", cluster.engines[1].pid, flush=True)
    os.kill(cluster.engines[1].pid, signal.SIGKILL)
    time.sleep(1)
    cell("after", "", "print('after', toy, 'total' in globals())")
    ip.run_line_magic("distrain", "stop")
    """
)


def _site(folder: Path) -> Path:
    """What installing the toy package leaves: its module, and its entry point."""
    info = folder / "nbdist_toy-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nbdist-toy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[nbdist.backends]\ntoy = nbdist_toy\n")
    (folder / "nbdist_toy.py").write_text((TOY / "nbdist_toy.py").read_text())
    return folder


def test_a_third_backend_runs_a_cell_exports_and_is_refused_a_healing(tmp_path):
    site = _site(tmp_path / "site")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    script = tmp_path / "train.py"
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(script)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out
    parts = dict(p.split("\n", 1) for p in out.split("=== ")[1:])
    pid = int(out.split("=== pid ")[1].split()[0])
    profile = parts["profile"]
    assert "--profile is not available for Toy cells: the toy framework has no profiler" in profile
    assert re.sub(r"wall [\d.]+ s", "wall N s", parts["first"]).splitlines() == [
        "<nbdist figure: loss and throughput>",  # the live panel, as a terminal shows it
        "[rank 0] rank 0 of 2",
        "[rank 1] rank 1 of 2",
        "<nbdist figure: loss and throughput>",
        "nbdist: final loss 1.5 (step 0, mean over ranks) · wall N s · 2 workers (toy)",
    ]
    assert parts["second"].splitlines() == ["[rank 0] total 0 (0, 2)", "[rank 1] total 10 (1, 2)"]
    # The healing is refused with the backend's reason, and the engines are replaced.
    assert parts["after"].splitlines()[:5] == [
        f"nbdist: rank 1 (host {os.uname().nodename}, pid {pid}) died after its last cell: killed "
        "by SIGKILL (kill -9, or the kernel's out-of-memory killer); not healed: a Toy session "
        "holds nothing a new rank could be given.",
        f"nbdist: rank 1 (host {os.uname().nodename}, pid {pid}) died after its last cell: killed "
        "by SIGKILL (kill -9, or the kernel's out-of-memory killer); replacing the engines",
        "nbdist: the workers were replaced; their variables (r, total, toy, w) are gone: re-run "
        "the cells that build them.",
        "[rank 0] after (0, 2) False",
        "[rank 1] after (1, 2) False",
    ]

    text = script.read_text()
    assert "2 cells ran on 2 workers (toy). Run one process per rank:" in text
    assert "TOY_RANK=1 TOY_WORLD=2 python train.py &" in text
    assert "print('total', total, toy)" in text
    ranks = [
        subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TOY_RANK": str(r), "TOY_WORLD": "2"},
            check=True,
        ).stdout  # fmt: skip
        for r in range(2)
    ]
    assert ranks == [
        "rank 0 of 2\n[rank 0] step 0 loss=2\ntotal 0 (0, 2)\n",
        "rank 1 of 2\n[rank 1] step 0 loss=1\ntotal 10 (1, 2)\n",
    ]
