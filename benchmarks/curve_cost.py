"""What CurveZMQ encryption of the local cluster's sockets costs: a warm cell's round trip and
the metrics stream (ipyparallel's ``publish_data``, which carries ``log(...)`` points).

Starts 2 local engines with and without ``--IPController.enable_curve`` (interleaved, so drift
hits both alike) and writes ``build/bench/curve_cost.{json,md}``.

    python benchmarks/curve_cost.py [--repeats 3] [--cells 30] [--messages 5000]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

OUT = Path(__file__).parents[1] / "build" / "bench"


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def publish(n: int) -> int:
    """Runs on an engine: ``n`` metric messages, one key each (datapub merges equal keys)."""
    from ipyparallel.datapub import publish_data

    for i in range(n):
        publish_data({f"m{i}": i})
    return n


def stream_rate(cluster, n: int) -> float:
    """Messages per second from one engine until the kernel has seen all ``n``."""
    start = time.perf_counter()
    ar = cluster.apply_async(0, publish, n)
    ar.get(timeout=120)
    while len(ar.data) < n:
        time.sleep(0.001)
    return n / (time.perf_counter() - start)


def measure(ip, magics, *, curve: bool, cells: int, messages: int) -> dict[str, float]:
    magics.cluster.encrypt = curve
    ip.run_line_magic("distrain", "start -n 2")
    flags = "--framework torch --no-plot --no-check"
    ip.run_cell_magic("distrain", flags, "x = rank\n")  # warm-up: imports, the group
    times = []
    for _ in range(cells):
        t = time.perf_counter()
        ip.run_cell_magic("distrain", flags, "x = rank\n")
        times.append(time.perf_counter() - t)
    stream_rate(magics.cluster, 200)  # warm-up
    rate = stream_rate(magics.cluster, messages)
    ip.run_line_magic("distrain", "stop")
    return {"cell_ms": median(times) * 1e3, "stream_msgs_per_s": rate}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cells", type=int, default=30)
    p.add_argument("--messages", type=int, default=5000)
    args = p.parse_args(argv)

    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    magics = ip.magics_manager.registry["DistrainMagics"]
    runs: dict[str, list[dict[str, float]]] = {"curve": [], "plain": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(
                measure(ip, magics, curve=name == "curve", cells=args.cells, messages=args.messages)
            )
    summary = {
        name: {key: median([r[key] for r in rs]) for key in rs[0]} for name, rs in runs.items()
    }
    result = {
        "machine": f"{platform.machine()}, {platform.processor() or '?'}, Python "
        f"{platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "repeats": args.repeats,
        "cells": args.cells,
        "messages": args.messages,
        "runs": runs,
        "median": summary,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "curve_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    c, n = summary["curve"], summary["plain"]
    md = (
        "| measure (2 local engines) | CurveZMQ | no encryption | change |\n|---|---|---|---|\n"
        f"| warm cell round trip (`x = rank`), median | {c['cell_ms']:.1f} ms | "
        f"{n['cell_ms']:.1f} ms | {(c['cell_ms'] / n['cell_ms'] - 1) * 100:+.0f}% |\n"
        f"| metrics stream (`publish_data`, one engine) | {c['stream_msgs_per_s']:,.0f} msg/s | "
        f"{n['stream_msgs_per_s']:,.0f} msg/s | "
        f"{(c['stream_msgs_per_s'] / n['stream_msgs_per_s'] - 1) * 100:+.0f}% |\n"
    )
    (OUT / "curve_cost.md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
