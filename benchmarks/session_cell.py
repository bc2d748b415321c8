"""The cost of one short cell in a session, two suites on the same warm engines (2 workers,
torch loaded) in the same IPython shell, in alternating rounds so machine drift hits all alike.

``--suite session`` (default): ``%%distrain`` against ipyparallel's ``%%px``:

- ``px``: ``%%px`` with ``print(rank)`` (``rank`` pushed once), ipyparallel's own magic;
- ``distrain``: ``%%distrain`` with ``print(rank)``;
- ``distrain-value``: ``%%distrain`` with ``rank * 10`` (a value per rank to show).

``--suite panel``: what the live panel and the final figure cost a short cell, a 200-step
``all_reduce`` + ``log(loss=...)`` loop (~0.2 s), with the panel (``panel``), with ``--no-plot``
(``no-plot``, the one-line summary only) and with ``--no-plot --no-autolog``.

    python benchmarks/session_cell.py [--suite session|panel] [--rounds 15] [--cells 20]

Each round times ``--cells`` cells of each variant; the report gives medians over rounds of the
per-cell time, and the ratio to the first variant. Writes ``build/bench/<suite>_cell.{json,md}``
(``session_cell``, ``panel_cell``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "build" / "bench"
SHORT_TRAINING = (
    "t = torch.ones(1)\nfor i in range(200):\n    dist.all_reduce(t)\n    log(loss=1.0 / (i + 1))\n"
)
SUITES = {
    "session": {
        "px": ("px", "", "print(rank)\n"),
        "distrain": ("distrain", "", "print(rank)\n"),
        "distrain-value": ("distrain", "", "rank * 10\n"),
    },
    "panel": {
        "no-plot": ("distrain", "--no-plot", SHORT_TRAINING),
        "no-plot-no-autolog": ("distrain", "--no-plot --no-autolog", SHORT_TRAINING),
        "panel": ("distrain", "", SHORT_TRAINING),
    },
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=SUITES, default="session")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cells", type=int, default=20)
    a = p.parse_args(argv)
    variants = SUITES[a.suite]
    first = next(iter(variants))
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    magics = shell.magics_manager.registry["DistrainMagics"]
    sink = io.StringIO()
    times: dict[str, list[float]] = {v: [] for v in variants}
    # Where a %%distrain cell's time goes, per phase (nbdist.kernel.phases): each phase's median.
    phases: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    try:
        with contextlib.redirect_stdout(sink):
            shell.run_cell_magic("distrain", "-n 2 --framework torch", "pass\n")
            view = magics.cluster._client[[e.engine_id for e in magics.cluster.engines]]
            view.block = True  # as %%px blocks in a notebook by default
            view.activate()  # %%px on exactly nbdist's engines
            for _ in range(3):  # warm-up of both paths
                for magic, line, cell in variants.values():
                    shell.run_cell_magic(magic, line, cell)
            for r in range(a.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for variant in order:
                    magic, line, cell = variants[variant]
                    start = time.perf_counter()
                    for _ in range(a.cells):
                        shell.run_cell_magic(magic, line, cell)
                        if magic == "distrain":
                            for name, t in magics.session.phases.times.items():
                                phases[variant].setdefault(name, []).append(t)
                    times[variant].append((time.perf_counter() - start) / a.cells)
    finally:
        shell.run_line_magic("unload_ext", "nbdist")
    med = {v: statistics.median(ts) * 1000 for v, ts in times.items()}
    phase_ms = {
        v: {name: statistics.median(ts) * 1000 for name, ts in by.items()}
        for v, by in phases.items()
        if by
    }
    result = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "rounds": a.rounds,
        "cells_per_round": a.cells,
        "median_ms": med,
        f"ratio_to_{first}": {v: med[v] / med[first] for v in variants},
        f"ms_over_{first}": {v: med[v] - med[first] for v in variants},
        "phases_median_ms": phase_ms,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{a.suite}_cell.json").write_text(json.dumps(result, indent=2))
    what = "A trivial warm cell" if a.suite == "session" else "A 200-step all_reduce + log cell"
    lines = [
        f"{what} on 2 workers ({result['machine']}; medians of {a.rounds} rounds "
        f"of {a.cells} cells each):",
        "",
        f"| variant | ms per cell | × `{first}` | ms over `{first}` |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{v}` | {med[v]:.1f} | {med[v] / med[first]:.2f} | {med[v] - med[first]:+.0f} |"
        for v in variants
    ]
    if phase_ms:
        names = list(next(iter(phase_ms.values())))
        lines += [
            "",
            "Where a `%%distrain` cell's time goes in the kernel (median ms per phase; `engine`: "
            "the slowest rank's own time in its task, within `watch`):",
            "",
            "| variant | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        lines += [
            f"| `{v}` | " + " | ".join(f"{by.get(n, 0.0):.2f}" for n in names) + " |"
            for v, by in phase_ms.items()
        ]
    (OUT / f"{a.suite}_cell.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
