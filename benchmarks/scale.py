"""The notebook kernel's side of a ``%%distrain`` run on N ranks, for N up to 1024, without N
engines: can one kernel keep up with hundreds of ranks' metrics, printed lines and panel?

Two parts, written to ``build/bench/scale.{json,md}``:

* **kernel** (simulated ranks): a generator thread plays the part of ipyparallel's IO thread
  for N ranks: it puts each rank's metric batches into that rank's ``data`` dict under
  ``nbdist-<seq>`` keys, exactly as ``nbdist.engine.metrics.Recorder`` publishes them (one
  batch per rank every ``flush_interval(N)``, points ``(step, time, {loss, samples, work,
  wait})`` as autolog records them, 10 points/s per rank), and appends a printed line per rank
  each second to that rank's ``stdout``. The kernel's real code consumes them in the loop
  ``nbdist.kernel.job.Job`` runs (``MetricsStream.pump`` per rank, ``OutputRelay.pump``,
  ``LiveView.update`` every ``PUMP_EVERY_S``, waiting ``POLL_S`` between), with the real
  widgets and figure; at the end ``LiveView.finish`` renders the final figure and summary.
* **transport** (real engines): 2 real ipyparallel engines publish, through ``publish_data``,
  the messages N ranks would send (same shapes and rate, split over the 2 engines); the kernel
  reads them with ``MetricsStream``. This measures what ipyparallel's data channel carries on
  this machine, which the simulated part takes for granted.

    python benchmarks/scale.py [--seconds 8] [--ranks 8,64,256,512,1024] [--no-transport]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1]))

from nbdist.engine.metrics import FLUSH_S, flush_interval  # noqa: E402
from nbdist.kernel.display import LiveView  # noqa: E402
from nbdist.kernel.job import POLL_S, PUMP_EVERY_S  # noqa: E402
from nbdist.kernel.metrics import MetricsStream, Rounds  # noqa: E402
from nbdist.kernel.relay import OutputRelay  # noqa: E402
from nbdist.protocol import KEY_PREFIX  # noqa: E402

OUT = Path(__file__).parents[1] / "build" / "bench"
POINTS_PER_S = 10
PRINT_EVERY_S = 1.0
BATCH = 32
HOSTS_OF = 8  # simulated ranks per host


class FakeTask:
    """What the kernel reads of one rank's ipyparallel task: ``data``, ``stdout``, ``stderr``."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.stdout = ""
        self.stderr = ""


class Sink:
    """The cell's stdout: records how long each relayed line took from its rank's print."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.lines = 0

    def write(self, text: str) -> None:
        now = time.monotonic()
        for line in text.splitlines():
            self.lines += 1
            _, _, stamp = line.rpartition("t=")
            if stamp:
                self.latencies.append(now - float(stamp))

    def flush(self) -> None:
        pass


def _point(rank: int, step: int, t: float) -> tuple[int, float, dict[str, float]]:
    work = 0.08 if rank % 97 == 3 else 0.05  # a few ranks work longer: the panel names them
    return (step, t, {"loss": 2.0 / (1 + 0.05 * step) + 0.001 * (rank % 7), "samples": BATCH,
                      "work": work, "wait": 0.1 - work})  # fmt: skip


class Generator(threading.Thread):
    """N ranks' metric batches and printed lines, put where ipyparallel would put them."""

    def __init__(self, tasks: list[FakeTask], seconds: float, flush_s: float) -> None:
        super().__init__(daemon=True)
        self.tasks, self.seconds, self.flush_s = tasks, seconds, flush_s
        self.produced = 0
        self.newest = 0.0  # time.time() of the newest point handed over
        self.cpu = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        n = len(self.tasks)
        start = time.time()
        start_mono = time.monotonic()
        step = [0] * n
        seq = [0] * n
        # Each rank's clock phase differs: flushes and prints are spread over the interval.
        phase = [(r * 0.6180339887) % 1.0 for r in range(n)]
        next_flush = [start + phase[r] * self.flush_s for r in range(n)]
        next_print = [start_mono + phase[r] * PRINT_EVERY_S for r in range(n)]
        cpu0 = time.thread_time()
        while True:
            now = time.time()
            mono = time.monotonic()
            end = now - start >= self.seconds
            for r in range(n):
                if now >= next_flush[r] or end:
                    upto = int((min(now, start + self.seconds) - start) * POINTS_PER_S)
                    points = [
                        _point(r, s, start + (s + 1) / POINTS_PER_S) for s in range(step[r], upto)
                    ]
                    if points:
                        self.tasks[r].data[f"{KEY_PREFIX}{seq[r]:08d}"] = points
                        seq[r] += 1
                        step[r] = upto
                        self.produced += len(points)
                        self.newest = max(self.newest, points[-1][1])
                    next_flush[r] += self.flush_s
                if mono >= next_print[r] and not end:
                    self.tasks[r].stdout += f"step {step[r]} loss 0.5 t={mono:.6f}\n"
                    next_print[r] += PRINT_EVERY_S
            if end:
                break
            time.sleep(0.01)
        self.cpu = time.thread_time() - cpu0
        self.done.set()


def _history_bytes(history: list[dict[str, Any]]) -> int:
    """The history's own memory: the list, each point's dict and its values (keys are shared)."""
    size = sys.getsizeof(history)
    for p in history:
        size += sys.getsizeof(p) + sum(sys.getsizeof(v) for v in p.values())
    return size


def kernel_run(n: int, seconds: float) -> dict[str, Any]:
    """The kernel's loop fed by N simulated ranks for ``seconds``."""
    tasks = [FakeTask() for _ in range(n)]
    sink = Sink()
    relay = OutputRelay([True] * n, sink, sink)
    stream = MetricsStream(n)
    shown: list[dict[str, Any]] = []
    live = LiveView(n, plot=True, smoothing=1.0, display=lambda b, **kw: shown.append(b),
                    expect_metrics=True)  # fmt: skip
    gen = Generator(tasks, seconds, flush_interval(n))
    states = ["running"] * n
    gc.collect()
    wall0, cpu0, loop_cpu0 = time.monotonic(), time.process_time(), time.thread_time()
    gen.start()
    newest_shown = newest_table = None
    staleness: list[float] = []
    table_lag: list[float] = []
    backlog_max = 0
    drawn = -1
    rounds = Rounds(n, PUMP_EVERY_S)
    reads = 0
    while not gen.done.is_set():
        due = rounds.next()
        reads += 3 * len(due)
        relay.pump(tasks, positions=due)
        for pos in due:
            task = tasks[pos]
            stream.pump(pos, task.data)
        if live.update(stream.history, states):
            # The panel is as far behind as the rank whose newest point it shows is oldest.
            times = [p["time"] for p in live.agg.last if "time" in p]
            newest_table = min(times) if len(times) == n else None  # once every rank has one
        if live.dashboard is not None and live.dashboard.drawn != drawn:
            drawn = live.dashboard.drawn
            newest_shown = newest_table
        if newest_shown is not None:
            staleness.append(time.time() - newest_shown)
        if newest_table is not None:
            table_lag.append(time.time() - newest_table)
        backlog_max = max(backlog_max, gen.produced - len(stream.history))
        time.sleep(max(0.0, PUMP_EVERY_S - POLL_S))  # the loop waits on the tasks in between
    loop_wall = time.monotonic() - wall0
    loop_cpu = time.thread_time() - loop_cpu0
    proc_cpu = time.process_time() - cpu0
    for pos, task in enumerate(tasks):
        stream.pump(pos, task.data)
    relay.pump(tasks, final=True)
    t = time.perf_counter()
    summary = live.finish(stream.history, ["done"] * n, wall=loop_wall, framework="torch")
    final_s = time.perf_counter() - t
    lat = sorted(sink.latencies) or [0.0]
    return {
        "ranks": n,
        "seconds": round(loop_wall, 2),
        "flush_s": flush_interval(n),
        "points_produced": gen.produced,
        "points_ingested": len(stream.history),
        "lost": gen.produced - len(stream.history) + len(stream.gaps),
        "points_per_s": len(stream.history) / loop_wall,
        "messages_per_s": sum(stream.received) / loop_wall,
        "kernel_loop_cpu_share": loop_cpu / loop_wall,
        "task_reads_per_s": reads / loop_wall,
        "process_cpu_share": proc_cpu / loop_wall,
        "generator_cpu_share": gen.cpu / loop_wall,
        "table_lag_p50_s": statistics.median(table_lag) if table_lag else None,
        "table_lag_max_s": max(table_lag) if table_lag else None,
        "figure_lag_p50_s": statistics.median(staleness) if staleness else None,
        "figure_lag_max_s": max(staleness) if staleness else None,
        "figure_draws": live.redraws,
        "backlog_max_points": backlog_max,
        "relay_lines": sink.lines,
        "relay_latency_p50_s": lat[len(lat) // 2],
        "relay_latency_max_s": lat[-1],
        "history_mb": _history_bytes(stream.history) / 1e6,
        "final_render_s": final_s,
        "summary": summary,
    }


def publish_for(ranks: list[int], seconds: float, flush_s: float) -> int:
    """Runs on an engine: the metric messages of ``ranks``, as their recorders would send
    them (one batch per rank every ``flush_s``), through the real ``publish_data``."""
    import time

    from ipyparallel.datapub import publish_data

    start = time.time()
    sent = 0
    step = {r: 0 for r in ranks}
    k = 0
    while True:
        now = time.time()
        end = now - start >= seconds
        upto = int((min(now, start + seconds) - start) * 10)
        for r in ranks:
            points = [(s, start + (s + 1) / 10, {"loss": 1.0, "samples": 32, "work": 0.05,
                       "wait": 0.05}) for s in range(step[r], upto)]  # fmt: skip
            if points:
                publish_data({f"nbdist-{k:08d}": points})
                k += 1
                sent += len(points)
                step[r] = upto
        if end:
            return sent
        time.sleep(max(0.0, flush_s - (time.time() - now)))


def transport_run(
    view: Any, engines: int, n: int, seconds: float, flush_s: float | None = None
) -> dict[str, Any]:
    """``n`` ranks' messages from ``engines`` real engines through ipyparallel, each rank
    sending every ``flush_s`` (default: ``flush_interval(n)``, what the recorders use)."""
    flush_s = flush_interval(n) if flush_s is None else flush_s
    ranks = [list(range(n))[e::engines] for e in range(engines)]
    stream = MetricsStream(engines)
    cpu0, wall0 = time.process_time(), time.monotonic()
    ars = [view.client[e].apply_async(publish_for, ranks[e], seconds, flush_s)
           for e in range(engines)]  # fmt: skip
    lags: list[float] = []
    while True:
        ready = all(ar.ready() for ar in ars)
        for pos, ar in enumerate(ars):
            before = len(stream.history)
            if stream.pump(pos, ar.data):
                now = time.time()
                lags.extend(now - p["time"] for p in stream.history[before:])
        if ready and len(stream.history) >= sum(ar.get() for ar in ars):
            break
        if time.monotonic() - wall0 > seconds + 30:
            break
        time.sleep(PUMP_EVERY_S)
    wall = time.monotonic() - wall0
    sent = sum(ar.get() for ar in ars)
    lags.sort()
    return {
        "ranks": n,
        "engines": engines,
        "flush_s": flush_s,
        "points_sent": sent,
        "points_received": len(stream.history),
        "messages_per_s": sum(stream.received) / wall,
        "points_per_s": len(stream.history) / wall,
        "drain_after_s": wall - seconds,
        "lag_p50_s": lags[len(lags) // 2] if lags else None,
        "lag_max_s": lags[-1] if lags else None,
        "kernel_cpu_share": (time.process_time() - cpu0) / wall,
    }


def read_cost(view: Any, reads: int = 3000) -> float:
    """Seconds one read of a running task's ``data``, ``stdout`` or ``stderr`` costs the
    kernel (``Job`` reads all three of every rank's task every ``PUMP_EVERY_S``)."""
    ar = view.client[0].apply_async(time.sleep, 5)
    time.sleep(0.5)
    t = time.perf_counter()
    for _ in range(reads // 3):
        ar.data, ar.stdout, ar.stderr  # noqa: B018 - the reads are what is timed
    took = (time.perf_counter() - t) / reads
    ar.get(timeout=30)
    return took


def startup(n: int) -> dict[str, Any]:
    """Seconds to start a controller with nbdist's settings and register ``n`` plain engines
    (no torch preloaded), and to stop them."""
    import logging

    import ipyparallel as ipp

    from nbdist.kernel.local import HEARTBEAT_MS

    t = time.perf_counter()
    cluster = ipp.Cluster(
        n=n,
        controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}",
                         f"--HeartMonitor.max_heartmonitor_misses={10_000 // HEARTBEAT_MS}"],
        log_level=logging.ERROR,
        load_profile=False,
    )  # fmt: skip
    rc = cluster.start_and_connect_sync()
    rc.wait_for_engines(n, timeout=300)
    up = time.perf_counter() - t
    t = time.perf_counter()
    rc[:].apply_sync(int, 1)  # one task on every engine
    task = time.perf_counter() - t
    t = time.perf_counter()
    rc.close()
    cluster.stop_cluster_sync()
    return {"engines": n, "register_s": up, "first_task_all_s": task,
            "stop_s": time.perf_counter() - t}  # fmt: skip


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    k = result["kernel"]
    lines = [
        f"Machine: {result['machine']}; {result['date']}; {result['seconds']} s per N, "
        f"{POINTS_PER_S} points/s and 1 printed line/s per rank.",
        "",
        "Kernel fed by N simulated ranks (real MetricsStream, OutputRelay, LiveView, figure); "
        "lag = now minus the newest point of the rank furthest behind, in the table (redrawn "
        "every 0.5 s) and in the figure (up to 16 ranks redrawn within 5% of a core, at most every "
        "2 s; past 16 ranks, min-max bands, with the table):",
        "",
        "| ranks | flush | points/s in | lost | kernel CPU | table lag p50 / max | "
        "figure lag p50 / max | relay latency p50 / max | history | final figure + summary |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in k:
        lines.append(
            f"| {r['ranks']} | {r['flush_s']:.2g} s | {r['points_per_s']:,.0f} | {r['lost']} | "
            f"{r['kernel_loop_cpu_share']:.0%} | {_fmt(r['table_lag_p50_s'], '.2f')} / "
            f"{_fmt(r['table_lag_max_s'], '.2f')} s | {_fmt(r['figure_lag_p50_s'], '.2f')} / "
            f"{_fmt(r['figure_lag_max_s'], '.2f')} s | {r['relay_latency_p50_s']:.2f} / "
            f"{r['relay_latency_max_s']:.2f} s | {r['history_mb']:.1f} MB | "
            f"{r['final_render_s']:.2f} s |"
        )
    if result.get("transport"):
        lines += [
            "",
            "Real transport: the same messages from 2 real engines through `publish_data` (the "
            "rows at 256+ ranks with a 0.1 s flush: every rank at `FLUSH_S`, as before the cap):",
            "",
            "| ranks | flush | messages/s | points/s | received / sent | lag p50 / max | "
            "kernel CPU |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["transport"]:
            lines.append(
                f"| {r['ranks']} | {r['flush_s']:.2g} s | {r['messages_per_s']:,.0f} | "
                f"{r['points_per_s']:,.0f} | {r['points_received']:,} / {r['points_sent']:,} | "
                f"{_fmt(r['lag_p50_s'], '.2f')} / {_fmt(r['lag_max_s'], '.2f')} s | "
                f"{r['kernel_cpu_share']:.0%} |"
            )
    if result.get("task_read_s"):
        us = result["task_read_s"] * 1e6
        lines += [
            "",
            f"One read of a running task's `data`/`stdout`/`stderr` (a real `AsyncResult`): "
            f"{us:.0f} µs. The kernel reads 3 a rank, every rank every {PUMP_EVERY_S:.2g} s up "
            "to 16 ranks, beyond that each rank once per flush interval (`Rounds`): "
            + ", ".join(
                f"{r['task_reads_per_s']:,.0f} reads/s = {r['task_reads_per_s'] * us / 1e6:.0%} "
                f"of a core at {r['ranks']} ranks"
                for r in k
            )
            + " (computed from that time and the reads the loop above made; the simulated "
            "tasks' own reads cost almost nothing).",
        ]
    if result.get("startup"):
        lines += [
            "",
            "Startup: a controller with nbdist's heartbeat (0.5 s) and N plain engines (no torch "
            "preloaded) on this machine:",
            "",
            "| engines | controller + all registered | one task on every engine | stop |",
            "|---|---|---|---|",
        ]
        for r in result["startup"]:
            lines.append(
                f"| {r['engines']} | {r['register_s']:.1f} s | {r['first_task_all_s']:.2f} s | "
                f"{r['stop_s']:.1f} s |"
            )
    return "\n".join(lines) + "\n"


def _write(result: dict[str, Any]) -> str:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (OUT / "scale.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--ranks", default="8,64,256,512,1024")
    p.add_argument("--no-transport", action="store_true")
    p.add_argument("--startup", default="8,16,32", help="engine counts to start ('' for none)")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.ranks.split(",")]

    kernel = []
    for n in sizes:
        r = kernel_run(n, args.seconds)
        kernel.append(r)
        shown = {k: v for k, v in r.items() if k != "summary"}
        sys.stderr.write(f"kernel {n}: {json.dumps(shown)}\n")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale-kernel.json").write_text(json.dumps(kernel, indent=2) + "\n")  # if the rest fails
    transport = []
    read_s = None
    if not args.no_transport:
        import ipyparallel as ipp

        with ipp.Cluster(n=2, log_level=40) as rc:
            rc.wait_for_engines(2, timeout=60)
            view = rc.direct_view()
            read_s = read_cost(view)
            runs = [(n, None) for n in sizes] + [(n, FLUSH_S) for n in sizes if n >= 256]
            for n, flush_s in runs:  # the last ones: every rank at FLUSH_S, as before the cap
                r = transport_run(view, 2, n, min(args.seconds, 4.0), flush_s)
                transport.append(r)
                sys.stderr.write(f"transport {n}: {json.dumps(r)}\n")
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "seconds": args.seconds,
        "kernel": kernel,
        "transport": transport,
        "task_read_s": read_s if transport else None,
        "startup": [],
    }
    _write(result)  # what is measured so far, should the startups fail
    for n in [int(x) for x in args.startup.split(",") if x]:
        result["startup"].append(startup(n))
        sys.stderr.write(f"startup {n}: {json.dumps(result['startup'][-1])}\n")
    sys.stdout.write(_write(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
