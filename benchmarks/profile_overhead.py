"""What ``%%distrain --profile`` costs a training cell, against the same cell without it, on the
same warm engines (2 workers, torch, gloo) in the same IPython shell, in alternating rounds so
that machine drift hits both alike.

The cell trains the MLP of tutorial 03 (batches of 512, 256-1024-1024-1) for ``--steps`` steps
and returns each step's time, measured on the rank itself around ``opt.step()`` to the next.
With ``--profile 5`` the steps fall in three groups: the 5 profiled ones (steps 3-7), the one
that closes the window (it summarises the events and writes the trace, on the training thread),
and the unprofiled rest. Reported: the median step time of each group and its ratio to the
median step of the cell without ``--profile``.

    python benchmarks/profile_overhead.py [--rounds 5] [--steps 30]

Writes ``build/bench/profile_overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "build" / "bench"
PROFILED = 5
SKIP = 2  # nbdist.engine.profiling.SKIP_STEPS
BUILD = """
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                  nn.Linear(1024, 1))
)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 256)
"""
TRAIN = """
import time
times, last = [], time.perf_counter()
for step in range(STEPS):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    now = time.perf_counter()
    times.append(now - last)
    last = now
times
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args(argv)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    sink = io.StringIO()
    groups: dict[str, list[float]] = {"plain": [], "profiled": [], "closing": [], "after": []}
    window_end = SKIP + PROFILED  # index of the step whose opt.step() closes the window
    OUT.mkdir(parents=True, exist_ok=True)
    os.chdir(OUT.parent)  # the traces land in build/nbdist-profile/
    try:
        with contextlib.redirect_stdout(sink):
            shell.run_cell_magic("distrain", "-n 2 --framework torch", BUILD)
            shell.user_ns["STEPS"] = a.steps
            shell.run_line_magic("distrain", "push STEPS")
            for r in range(a.rounds + 1):  # the first round warms both paths up
                order = (False, True) if r % 2 == 0 else (True, False)
                for profile in order:
                    flags = f"--no-plot -o res{' --profile 5' if profile else ''}"
                    shell.run_cell_magic("distrain", flags, TRAIN)
                    if r == 0:
                        continue
                    steps = shell.user_ns["res"].values  # per rank, each step's seconds
                    slowest = [max(ts) for ts in zip(*steps, strict=True)]
                    if not profile:
                        groups["plain"] += slowest[window_end + 1 :]
                    else:
                        groups["profiled"] += slowest[SKIP : window_end - 1]
                        groups["closing"].append(slowest[window_end - 1])
                        groups["after"] += slowest[window_end + 1 :]
    finally:
        shell.run_line_magic("unload_ext", "nbdist")
    med = {g: statistics.median(ts) * 1000 for g, ts in groups.items()}
    result = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "rounds": a.rounds,
        "steps_per_cell": a.steps,
        "median_step_ms": med,
        "ratio_to_plain": {g: med[g] / med["plain"] for g in groups},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "profile_overhead.json").write_text(json.dumps(result, indent=2))
    what = {
        "plain": "without --profile (steps after the 8th)",
        "profiled": "--profile 5: the profiled steps",
        "closing": "--profile 5: the step that closes the window (summary, trace)",
        "after": "--profile 5: the steps after it",
    }
    lines = [
        f"Step time of tutorial 03's MLP on 2 workers ({result['machine']}; slowest rank per "
        f"step, medians over {a.rounds} rounds of a {a.steps}-step cell each way):",
        "",
        "| steps | ms per step | × without --profile |",
        "|---|---|---|",
    ]
    lines += [f"| {what[g]} | {med[g]:.1f} | {med[g] / med['plain']:.2f} |" for g in groups]
    (OUT / "profile_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
