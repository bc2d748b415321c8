"""Cost of recording metrics on a worker: one ``log(...)`` call, and autolog per training step.

Runs on 2 real local engines through ``%%distrain`` and writes ``build/bench/log_cost.json`` and
``build/bench/log_cost.md``. The issue's target: a 10 ms training step slows by < 1%.

    python benchmarks/log_cost.py [--calls 200000] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

OUT = Path(__file__).parents[1] / "build" / "bench"

LOG_CELL = """
import time
def bench(n, f):
    t = time.perf_counter()
    for i in range(n):
        f(i)
    return (time.perf_counter() - t) / n
empty = bench(__CALLS__, lambda i: None)
logged = bench(__CALLS__, lambda i: log(loss=0.5, samples=32))
(empty, logged)
"""

# A step that takes ~10 ms of compute on one worker; timed with and without autolog.
STEP_CELL = """
import time
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(512, 512), nn.ReLU(),
                                                          nn.Linear(512, 1)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(__BATCH__, 512)
def step():
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
for _ in range(20):
    step()
t = time.perf_counter()
for _ in range(__STEPS__):
    step()
(time.perf_counter() - t) / __STEPS__
"""


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    ip.run_line_magic("distrain", "start -n 2")
    flags = "-n 2 --framework torch --no-plot -o r"
    ip.run_cell_magic("distrain", flags, "x = 1")

    per_call = []
    for _ in range(args.repeats):
        ip.run_cell_magic("distrain", flags, LOG_CELL.replace("__CALLS__", str(args.calls)))
        (empty, logged), _ = ip.user_ns["r"].values
        per_call.append(logged - empty)

    step_cell = STEP_CELL.replace("__BATCH__", str(args.batch)).replace(
        "__STEPS__", str(args.steps)
    )
    with_autolog, without = [], []
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        ip.run_cell_magic("distrain", flags, step_cell)
        with_autolog.append(median(ip.user_ns["r"].values))
        ip.run_cell_magic("distrain", flags + " --no-autolog", step_cell)
        without.append(median(ip.user_ns["r"].values))
    ip.run_line_magic("distrain", "stop")

    call_s = median(per_call)
    step_on, step_off = median(with_autolog), median(without)
    result = {
        "machine": f"{platform.machine()}, {platform.processor() or '?'}, Python "
        f"{platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "log_call_us": call_s * 1e6,
        "log_cost_for_10ms_step_pct": call_s / 0.010 * 100,
        "step_ms_autolog": step_on * 1e3,
        "step_ms_no_autolog": step_off * 1e3,
        "autolog_overhead_pct": (step_on / step_off - 1) * 100,
        "repeats": args.repeats,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "log_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (
        "| measure | value |\n|---|---|\n"
        f"| one `log(loss=..., samples=...)` call | {result['log_call_us']:.1f} µs |\n"
        f"| ... as a share of a 10 ms step (target < 1%) | "
        f"{result['log_cost_for_10ms_step_pct']:.2f}% |\n"
        f"| DDP step with autolog | {result['step_ms_autolog']:.2f} ms |\n"
        f"| DDP step with --no-autolog | {result['step_ms_no_autolog']:.2f} ms |\n"
        f"| autolog overhead per step | {result['autolog_overhead_pct']:+.2f}% |\n"
    )
    (OUT / "log_cost.md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
