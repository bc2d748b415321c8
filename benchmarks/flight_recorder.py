"""What torch's flight recorder costs a collective: nbdist turns it on for its process groups
(``TORCH_FR_BUFFER_SIZE``, read when a group is made) so that a stall's report can say which
rank is behind. Two plain processes (``torch.multiprocessing.spawn``, gloo, one thread each),
an ``all_reduce`` of ``--numel`` floats timed ``--iters`` times, with and without the
recorder, in alternating runs so that machine drift hits both alike.

    python benchmarks/flight_recorder.py [--runs 8] [--iters 3000] [--numel 1000]

Writes ``build/bench/flight_recorder.json``: each run's microseconds per all-reduce, and the
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, recorder: bool, port: int, iters: int, numel: int, out: str) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "256" if recorder else "0"
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.ones(numel)
    for _ in range(200):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(str((time.perf_counter() - start) / iters * 1e6))
    dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--numel", type=int, default=1000)
    args = p.parse_args()
    out = Path("build/bench")
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / "flight_recorder.tmp"
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(args.runs):
        for recorder in (False, True) if i % 2 == 0 else (True, False):
            mp.spawn(
                _rank,
                args=(recorder, _free_port(), args.iters, args.numel, str(scratch)),
                nprocs=2,
            )
            runs["on" if recorder else "off"].append(float(scratch.read_text()))
    scratch.unlink()
    medians = {k: statistics.median(v) for k, v in runs.items()}
    report = {
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or 'cpu'}",
        "torch": torch.__version__,
        "numel": args.numel,
        "iters": args.iters,
        "us_per_all_reduce": runs,
        "median_us": medians,
        "ratio_on_to_off": medians["on"] / medians["off"],
    }
    (out / "flight_recorder.json").write_text(json.dumps(report, indent=1))
    print(
        f"all_reduce of {args.numel} floats, 2 gloo processes: recorder off "
        f"{medians['off']:.0f} us, on {medians['on']:.0f} us "
        f"({medians['on'] / medians['off']:.3f}x), medians of {args.runs} runs"
    )


if __name__ == "__main__":
    main()
