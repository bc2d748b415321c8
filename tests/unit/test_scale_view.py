"""The panel beyond MANY_RANKS ranks: ranks summarised (a band, rows per host), on synthetic
streams with exact results; the running aggregates equal what the full history says."""

import io
import random
import statistics
from dataclasses import replace
from types import SimpleNamespace

from nbdist.engine.metrics import FLUSH_S, flush_interval
from nbdist.errors import RankFailure, WorkerError
from nbdist.kernel.commands import host_memory_lines
from nbdist.kernel.curves import BAND_S, Aggregate, RankBands
from nbdist.kernel.display import LiveView, host_table_html, table_html
from nbdist.kernel.engines import EngineInfo, status_text
from nbdist.kernel.figure import BAND_TITLE, Figure
from nbdist.kernel.metrics import Rounds
from nbdist.kernel.options import RunOptions, parse_run_options
from nbdist.kernel.relay import OutputRelay
from nbdist.protocol import MemoryReport
from nbdist.ranks import MANY_RANKS

WORLD = 24
HOSTS = [f"node{r // 8}" for r in range(WORLD)]  # node0: ranks 0-7, node1: 8-15, node2: 16-23


def stream(world=WORLD, steps=40, dt=0.125, start=1000.0):
    """Rank r: a step every ``dt`` (exact in binary), ``r + 1`` samples a step (so ``8 (r + 1)``
    samples/s), loss ``1 + r / 100 + 1 / (step + 1)``, work 10 ms (rank 5: 30 ms, which the
    others wait for)."""
    return [
        {"rank": r, "step": s, "time": start + (s + 1) * dt, "samples": r + 1,
         "loss": 1 + r / 100 + 1 / (s + 1), "work": 0.03 if r == 5 else 0.01,
         "wait": 0.0 if r == 5 else 0.02}
        for s in range(steps)
        for r in range(world)
    ]  # fmt: skip


def test_flush_interval_keeps_small_jobs_as_they_were_and_caps_the_message_rate():
    assert [flush_interval(n) for n in (1, 8, 16, 100)] == [FLUSH_S] * 4
    assert flush_interval(512) == 0.512
    assert flush_interval(1024) == 1.024


def test_bands_of_a_steady_stream_are_exact():
    agg = Aggregate(WORLD, start=1000.0)
    agg.add(stream())
    t, mean, lo, hi, total = agg.bands.curve()
    # Rates from each rank's second point (t = 1000.25) to its last (1005.0): bins 0 .. 10.
    assert t == [(b + 1) * BAND_S for b in range(11)]
    assert lo == [8.0] * 11 and hi == [8.0 * WORLD] * 11
    assert mean == [8.0 * (WORLD + 1) / 2] * 11
    assert total == [8.0 * WORLD * (WORLD + 1) / 2] * 11


def test_a_bin_is_closed_once_every_rank_has_passed_it_and_later_points_still_count():
    bands = RankBands(3, start=0.0)
    bands.add(0, 0.1, 10.0)
    bands.add(1, 0.2, 20.0)
    bands.add(2, 0.3, 30.0)
    bands.add(0, 1.1, 40.0)  # rank 0 in bin 2; ranks 1 and 2 still in bin 0
    assert bands.curve() == ([0.5, 1.0, 1.5], [20.0] * 2 + [30.0], [10.0] * 2 + [20.0],
                             [30.0, 30.0, 40.0], [60.0] * 2 + [90.0])  # fmt: skip
    bands.add(1, 0.6, 50.0)  # arrives late, for bin 1 (not closed yet: rank 2 is in bin 0)
    bands.add(2, 1.2, 60.0)
    t, mean, lo, hi, total = bands.curve()
    assert t == [0.5, 1.0, 1.5]
    assert total == [60.0, 90.0, 150.0]
    assert (lo, hi) == ([10.0, 10.0, 40.0], [30.0, 50.0, 60.0])


def test_a_rank_that_never_counts_samples_does_not_hold_the_bands_back():
    bands = RankBands(2, start=0.0)
    bands.add(0, 0.1, 10.0)
    bands.add(0, 5.1, 10.0)
    t, _, _, _, total = bands.curve()
    assert len(t) == 11 and total == [10.0] * 11


def test_running_loss_statistics_equal_the_full_history_even_with_a_step_logged_twice():
    rng = random.Random(1)
    history = [
        {"rank": r, "step": rng.randrange(30), "time": 0.0, "loss": rng.uniform(0.1, 5)}
        for r in rng.choices(range(WORLD), k=2000)
    ]
    agg = Aggregate(WORLD)
    for i in range(0, len(history), 37):
        agg.add(history[: i + 37])
    last: dict[int, dict[int, float]] = {}
    for p in history:
        last.setdefault(p["step"], {})[p["rank"]] = p["loss"]
    steps = sorted(last)
    assert agg.loss_curve() == (
        steps,
        [sum(last[s].values()) / len(last[s]) for s in steps],
        [min(last[s].values()) for s in steps],
        [max(last[s].values()) for s in steps],
    )


def test_stragglers_equal_the_median_of_the_others_for_every_rank():
    rng = random.Random(2)
    agg = Aggregate(40)
    works = [rng.choice([0.010, 0.012, 0.02, 0.05]) for _ in range(40)]
    waits = [max(works) - w for w in works]  # in step: each waits for the slowest
    agg.add([{"rank": r, "step": s, "time": 0.0, "work": works[r], "wait": waits[r]}
             for s in range(40) for r in range(40)])  # fmt: skip
    expected = []
    for r, mine in enumerate(works):
        others = statistics.median(w for q, w in enumerate(works) if q != r)
        share = statistics.median(waits[q] / (works[q] + waits[q]) for q in range(40) if q != r)
        if (
            mine > 1.25 * others
            and mine - others > 0.001
            and (mine - others) * 40 >= 0.5
            and share >= 0.1
        ):
            expected.append((r, mine / others))
    assert agg.stragglers() == expected and expected


def test_the_table_groups_ranks_by_host_beyond_the_per_rank_limit():
    agg = Aggregate(WORLD, start=1000.0)
    points = [p for p in stream() if not (p["rank"] == 9 and p["step"] > 20)]  # rank 9 behind
    agg.add(points)
    states = ["running"] * WORLD
    states[17] = "failed"
    html = table_html(agg, states, 1010.0, HOSTS)
    assert html == host_table_html(agg, states, 1010.0, HOSTS)
    head = "<th>host</th><th>ranks</th><th>state</th><th>step</th><th>loss</th>"
    assert head in html and "<td>0</td><td>running</td>" not in html  # no row per rank
    # node0: ranks 0-7 at step 39; losses 1 + r/100 + 1/40; 8 (r + 1) samples/s; rank 5: 30 ms.
    assert (
        "<tr><td>node0</td><td>8</td><td>8 running</td><td>39 / 39 / 39</td>"
        "<td>1.025 / 1.06 / 1.095</td><td>8 / 36 / 64</td><td>10 / 10 / 30 ms</td>"
        "<td>10.0 s</td><td></td></tr>"
    ) in html
    assert "<tr><td>node1</td><td>8</td><td>8 running</td><td>20 / 39 / 39</td>" in html
    assert "<tr><td>node2</td><td>8</td><td>7 running, 1 failed</td><td>39 / 39 / 39</td>" in html
    assert html.count("<tr>") == 4  # the head and one row per host
    assert (
        "slowest ranks (work/step): <b>rank 5 (node0) 30 ms (3.0× the others)</b>, "
        "rank 0 (node0) 10 ms, rank 1 (node0) 10 ms, rank 2 (node0) 10 ms, rank 3 (node0) 10 ms"
    ) in html


def test_the_table_keeps_a_row_per_rank_up_to_the_limit():
    agg = Aggregate(MANY_RANKS, start=1000.0)
    agg.add(stream(MANY_RANKS))
    html = table_html(agg, ["running"] * MANY_RANKS, 1010.0, HOSTS[:MANY_RANKS])
    assert html.count("<tr>") == MANY_RANKS + 1 and "<th>host</th>" not in html


def test_the_figure_draws_the_ranks_mean_in_a_band_and_the_total_in_the_title():
    agg = Aggregate(WORLD, start=1000.0)
    agg.add(stream())
    fig = Figure(WORLD)
    fig.draw(agg)
    lines = fig.ax_rate.get_lines()
    assert lines == [fig.total_line] and fig.ax_rate.get_legend() is None
    assert list(fig.total_line.get_ydata()) == [100.0] * 11  # 8 x (1 + ... + 24) / 24
    assert fig.ax_rate.get_title() == f"{BAND_TITLE}; total 2,400"
    band = fig.rate_band.get_paths()[0].vertices[:, 1]
    assert min(band) == 8.0 and max(band) == 192.0
    fig.reset()
    assert fig.rate_band is None and fig.ax_rate.get_title() == BAND_TITLE


def test_the_live_view_passes_each_ranks_host_to_the_table(monkeypatch):
    shown = []
    live = LiveView(WORLD, plot=True, smoothing=1.0, hosts=HOSTS,
                    display=lambda b, **kw: shown.append(b))  # fmt: skip
    history = stream()
    live.update(history, ["running"] * WORLD, force=True)
    assert "<td>node2</td>" in live.dashboard.table.value
    summary = live.finish(history, ["done"] * WORLD, wall=5.0, framework="torch")
    assert "24 workers (torch)" in summary and "rank 5 keeps the others waiting" in summary


def _tasks(texts):
    return [SimpleNamespace(stdout=t, stderr="") for t in texts]


def test_beyond_the_limit_rank_0_is_shown_and_the_others_lines_counted():
    out = io.StringIO()
    relay = OutputRelay.for_job(list(range(20)), RunOptions(), out, io.StringIO())
    texts = ["a\nb\n"] + [f"x{r}\n" * (r % 4) for r in range(1, 20)]
    texts[19] += "unfinished"  # a last line without its newline counts too
    relay.pump(_tasks(texts))
    relay.pump(_tasks(texts), final=True)
    # ranks 1..19 print r % 4 lines: 1,2,3,0 repeating (1..16 -> 4 x 6 = 24, 17..19: 1+2+3),
    # rank 19 one more.
    assert out.getvalue() == (
        "[rank 0] a\n[rank 0] b\n"
        "nbdist: 19 other ranks printed 31 lines, not shown here (shown: rank 0); per rank "
        "0 / 2 / 4 (min / median / max), most: rank 19 4, rank 3 3, rank 7 3. `--ranks all` "
        "shows every rank's lines, `--ranks 3,5` some; all are kept in the result (`-o res`, "
        "then `res.stdout[rank]`).\n"
    )


def test_ranks_all_shows_every_rank_and_small_jobs_are_as_before():
    for world, opts in ((20, parse_run_options("--ranks all")), (MANY_RANKS, RunOptions())):
        out = io.StringIO()
        relay = OutputRelay.for_job(list(range(world)), opts, out, io.StringIO())
        texts = [f"r{r}\n" for r in range(world)]
        relay.pump(_tasks(texts), final=True)
        assert out.getvalue() == "".join(f"[rank {r}] r{r}\n" for r in range(world))


def test_chosen_ranks_at_scale_are_shown_without_a_note():
    out = io.StringIO()
    relay = OutputRelay.for_job(list(range(20)), parse_run_options("--ranks 2,5"), out, out)
    relay.pump(_tasks([f"r{r}\n" for r in range(20)]), final=True)
    assert out.getvalue() == "[rank 2] r2\n[rank 5] r5\n"


def test_ranks_all_parses():
    opts = parse_run_options("--ranks all")
    assert (opts.ranks, opts.all_output) == (None, True)
    assert parse_run_options("--ranks 0,3") == RunOptions(ranks=(0, 3))


def test_status_groups_engines_by_host_beyond_the_limit():
    engines = [
        EngineInfo(rank=r, engine_id=100 + r, host=f"n{r // 10}", address=f"10.0.0.{r // 10}",
                   pid=1000 + r, gpu=str(r % 10), visible="0,1,2,3,4,5,6,7,8,9",
                   cuda_index=r % 10, cpus=4, local_rank=r % 10, local_world_size=10)
        for r in range(20)
    ]  # fmt: skip
    busy = {r: 1 for r in (0, 1, 2, 3, 7, 12, 13)}
    assert status_text(engines, source="connected", busy=busy, warm={"torch"}).splitlines() == [
        "nbdist: 20 workers on 2 hosts, connected",
        "  n0 (10.0.0.0): 10 engines, ranks 0-9, GPUs 0,1,2,3,4,5,6,7,8,9, 5 busy, 5 idle",
        "  n1 (10.0.0.1): 10 engines, ranks 10-19, GPUs 0,1,2,3,4,5,6,7,8,9, 2 busy, 8 idle",
        "busy ranks: 0-3, 7, 12-13",
        "frameworks loaded: torch",
    ]


def _failure(rank, message, time_=1.0):
    return RankFailure(rank=rank, host=f"n{rank // 8}", exc_type="ValueError", message=message,
                       traceback=f"Traceback ...\nValueError: {message}\n", line=3,
                       line_text="raise ValueError(...)", time=time_)  # fmt: skip


def test_512_identical_failures_are_one_message_with_one_traceback():
    err = WorkerError([_failure(r, "bad batch") for r in range(512)])
    assert str(err) == (
        "512 ranks 0-511 (host n0, n1, n10, ... 64 hosts) raised ValueError: bad batch\n"
        "  at the cell, line 3: raise ValueError(...)"
    )
    shown = err._render_traceback_()
    assert shown.count("--- remote traceback, 512 ranks 0-511 ---") == 1 and len(shown) == 8


def test_512_different_failures_show_three_and_count_the_rest():
    failures = [_failure(r, f"bad value {r}") for r in range(512)]
    failures[7] = replace(failures[7], exc_type="KeyError")
    err = WorkerError(failures)
    lines = str(err).splitlines()
    assert lines == [
        "rank 0 (host n0) raised ValueError: bad value 0",
        "  at the cell, line 3: raise ValueError(...)",
        "rank 1 (host n0) raised ValueError: bad value 1",
        "  at the cell, line 3: raise ValueError(...)",
        "rank 2 (host n0) raised ValueError: bad value 2",
        "  at the cell, line 3: raise ValueError(...)",
        "... and 509 more different failures on 509 ranks 3-511 (ValueError ×508, KeyError ×1); "
        "each is in the error's .failures (sys.last_value.failures after the cell)",
    ]
    assert len(err.failures) == 512
    assert sum(ln.startswith("--- remote traceback") for ln in err._render_traceback_()) == 3


def test_rounds_read_every_rank_each_pump_up_to_16_then_once_per_flush():
    small = Rounds(MANY_RANKS, 0.05)
    assert [list(small.next()) for _ in range(2)] == [list(range(MANY_RANKS))] * 2
    big = Rounds(512, 0.05)  # a message every 0.512 s per rank: read every 10 pumps
    pumps = [list(big.next()) for _ in range(10)]
    assert pumps[0][:3] == [0, 10, 20] and pumps[9][:2] == [9, 19]
    assert sorted(p for pump in pumps for p in pump) == list(range(512))  # each once
    assert list(big.next()) == pumps[0]


def test_status_memory_beyond_the_limit_is_per_host():
    reports = [
        MemoryReport(rss=(100 + r) * 2**20, gpu=None, gpus=[], variables=r % 3) for r in range(20)
    ]
    hosts = ["a"] * 10 + ["b"] * 10
    assert host_memory_lines(reports, hosts) == [
        "memory per host (min / median / max over its ranks):",
        "  a: 10 ranks, 100 MB / 104 MB / 109 MB, variables 0 / 1 / 2",
        "  b: 10 ranks, 110 MB / 114 MB / 119 MB, variables 0 / 1 / 2",
        "most memory: rank 19 119 MB, rank 18 118 MB, rank 17 117 MB, rank 16 116 MB, "
        "rank 15 115 MB",
    ]
