"""How many students' notebooks one server holds: 1, 2, 4 and 8 notebooks at once, each a
student's own (its own kernel, its own 2 workers), as a course's JupyterHub runs them.

Each notebook is what a student writes: ``%load_ext nbdist``, a cell with a ``@dataclass``
config and a ``class Net(nn.Module)``, a ``%%distrain -n 2`` cell that trains it with DDP for a
fixed number of seeded steps, and a cell that reads the result. The notebooks run at the same
time, each in a process of its own with nbclient (as the hub's single-user servers run their
kernels; here one Unix user runs them all). For each count the report gives the slowest
notebook's time and its ratio to one notebook alone, the peak memory of everything the
notebooks started (kernels, controllers, engines: proportional set sizes summed, sampled every
0.5 s), per notebook, per worker and for the rest (the kernel, the workers' controller, and the
nbclient process that stands for the student's notebook server), and whether every notebook
ran to its end with the final loss its seed gives (they share the seed).

    python benchmarks/course_server.py [--counts 1,2,4,8] [--steps 300]

Writes ``build/bench/course_server.{json,md}``; ``docs/teaching.md`` quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import psutil

OUT = Path(__file__).resolve().parent.parent / "build" / "bench"

CELLS = [
    "%load_ext nbdist",
    """from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Config:
    hidden: int = 256
    lr: float = 0.05
    steps: int = {steps}


class Net(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 1))

    def forward(self, x):
        return self.body(x)


cfg = Config()""",
    """%%distrain -n 2 --push cfg,Net -o run
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = DDP(Net(cfg))
opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
g = torch.Generator().manual_seed(rank)
for step in range(cfg.steps):
    x = torch.randn(128, 64, generator=g)
    loss = ((model(x) - x[:, :1]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    log(loss=loss.item())""",
    "print('final loss', round(run.history[-1]['loss'], 6))",
]

RUNNER = """
import sys, time, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
start = time.perf_counter()
NotebookClient(nb, timeout=600, kernel_name="python3").execute()
took = time.perf_counter() - start
out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("name") == "stdout")
print("RESULT", took, out.strip().split()[-1], flush=True)
"""


def notebook(folder: Path, steps: int) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.replace("{steps}", str(steps))) for c in CELLS]
    path = folder / "student.ipynb"
    nbformat.write(nb, path)
    return path


def memory(roots: list[psutil.Process]) -> tuple[int, int]:
    """(the workers' engines, everything else) the notebooks started, in bytes: proportional
    set sizes (shared library pages split between the processes that map them, so the sum is
    what the machine holds; RSS would count torch's libraries once per process)."""
    engines = rest = 0
    for root in roots:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                size = p.memory_full_info().pss
                engine = "nbdist.engine.boot" in " ".join(p.cmdline())
            except psutil.Error:
                continue
            if engine:
                engines += size
            else:
                rest += size
    return engines, rest


def run_at_once(count: int, path: Path) -> dict:
    env = {**os.environ, "NBDIST_PRESTART": "0", "IPP_NONINTERACTIVE": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", RUNNER, str(path)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, cwd=path.parent)
        for _ in range(count)
    ]  # fmt: skip
    roots = [psutil.Process(p.pid) for p in procs]
    peak, peak_engines, peak_rest, done = 0, 0, 0, threading.Event()

    def sample() -> None:
        nonlocal peak, peak_engines, peak_rest
        while not done.is_set():
            engines, rest = memory(roots)
            if engines + rest > peak:
                peak, peak_engines, peak_rest = engines + rest, engines, rest
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    outputs = [p.communicate()[0] for p in procs]
    done.set()
    sampler.join()
    results = []
    for p, text in zip(procs, outputs, strict=True):
        line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise SystemExit(f"a notebook failed ({p.returncode}):\n{text[-3000:]}")
        _, took, loss = line.split()
        results.append((float(took), loss))
    times = [t for t, _ in results]
    return {
        "notebooks": count,
        "slowest_s": round(max(times), 1),
        "median_s": round(statistics.median(times), 1),
        "peak_mb": round(peak / 2**20),  # at that moment: the engines, and the rest
        "engines_mb": round(peak_engines / 2**20),
        "rest_mb": round(peak_rest / 2**20),
        "losses": sorted({loss for _, loss in results}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--counts", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        path = notebook(Path(folder), args.steps)
        rows = []
        for count in counts:
            row = run_at_once(count, path)
            rows.append(row)
            print(json.dumps(row), flush=True)
    alone = rows[0]["slowest_s"] if rows[0]["notebooks"] == 1 else None
    machine = {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "course_server.json").write_text(
        json.dumps({"machine": machine, "steps": args.steps, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        f"Notebooks at once, each `%%distrain -n 2` ({args.steps} DDP steps), on "
        f"{machine['cpus']} CPUs and {machine['memory_gb']} GB ({machine['platform']}):",
        "",
        "| notebooks | slowest | vs one alone | peak memory | per notebook | per worker | "
        "the rest per notebook | same loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        n = row["notebooks"]
        ratio = f"{row['slowest_s'] / alone:.1f}×" if alone else "-"
        lines.append(
            f"| {n} | {row['slowest_s']} s | {ratio} | {row['peak_mb']:,} MB | "
            f"{row['peak_mb'] / n:,.0f} MB | {row['engines_mb'] / n / 2:,.0f} MB | "
            f"{row['rest_mb'] / n:,.0f} MB | "
            f"{'yes' if len(row['losses']) == 1 else 'NO: ' + ', '.join(row['losses'])} |"
        )
    (OUT / "course_server.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
