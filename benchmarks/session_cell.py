"""The cost of one short cell in a session: ``%%distrain`` against ipyparallel's ``%%px``.

Both run on the same warm engines (2 workers, torch loaded) in the same IPython shell, in
alternating rounds so machine drift hits both alike:

- ``px``: ``%%px`` with ``print(rank)`` (``rank`` pushed once), ipyparallel's own magic;
- ``distrain``: ``%%distrain`` with ``print(rank)``;
- ``distrain-value``: ``%%distrain`` with ``rank * 10`` (a value per rank to show).

    python benchmarks/session_cell.py [--rounds 15] [--cells 20]

Each round times ``--cells`` cells of each variant; the report gives medians over rounds of the
per-cell time, and the ratio to ``%%px``. Writes ``build/bench/session_cell.{json,md}``.
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
VARIANTS = {
    "px": ("px", "", "print(rank)\n"),
    "distrain": ("distrain", "", "print(rank)\n"),
    "distrain-value": ("distrain", "", "rank * 10\n"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cells", type=int, default=20)
    a = p.parse_args(argv)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    magics = shell.magics_manager.registry["DistrainMagics"]
    sink = io.StringIO()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        with contextlib.redirect_stdout(sink):
            shell.run_cell_magic("distrain", "-n 2 --framework torch", "pass\n")
            view = magics.cluster._client[[e.engine_id for e in magics.cluster.engines]]
            view.block = True  # as %%px blocks in a notebook by default
            view.activate()  # %%px on exactly nbdist's engines
            for _ in range(3):  # warm-up of both paths
                for magic, line, cell in VARIANTS.values():
                    shell.run_cell_magic(magic, line, cell)
            for r in range(a.rounds):
                order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
                for variant in order:
                    magic, line, cell = VARIANTS[variant]
                    start = time.perf_counter()
                    for _ in range(a.cells):
                        shell.run_cell_magic(magic, line, cell)
                    times[variant].append((time.perf_counter() - start) / a.cells)
    finally:
        shell.run_line_magic("unload_ext", "nbdist")
    med = {v: statistics.median(ts) * 1000 for v, ts in times.items()}
    result = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "rounds": a.rounds,
        "cells_per_round": a.cells,
        "median_ms": med,
        "ratio_to_px": {v: med[v] / med["px"] for v in VARIANTS},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "session_cell.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"A trivial warm cell on 2 workers ({result['machine']}; medians of {a.rounds} rounds "
        f"of {a.cells} cells each):",
        "",
        "| variant | ms per cell | × %%px |",
        "|---|---|---|",
    ]
    lines += [f"| `{v}` | {med[v]:.1f} | {med[v] / med['px']:.2f} |" for v in VARIANTS]
    (OUT / "session_cell.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
