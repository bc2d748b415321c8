"""The scaling study's arithmetic and report (``%%distrain --scan``)."""

import base64

import pytest

from nbdist import DistrainResult, ScanResult
from nbdist.kernel.scan import run_scan, throughput


def _run(world, wall, samples_per_rank=None):
    history = ()
    if samples_per_rank is not None:
        history = tuple(
            {"rank": r, "step": s, "time": float(s), "samples": samples_per_rank / 4}
            for r in range(world)
            for s in range(4)
        )
    return DistrainResult(framework="torch", world_size=world, wall=wall, ranks=(), history=history)


def test_throughput_is_all_samples_over_wall_or_runs_per_second():
    assert throughput(_run(2, 4.0, samples_per_rank=1000)) == (500.0, "samples/s")
    assert throughput(_run(2, 4.0)) == (0.25, "runs/s")


def test_speedup_efficiency_and_ideal():
    scan = ScanResult(
        workers=(1, 2, 4), runs=(), throughput=(100.0, 150.0, 200.0), unit="samples/s"
    )
    assert scan.speedup == [1.0, 1.5, 2.0]
    assert scan.efficiency == [1.0, 0.75, 0.5]
    assert scan.ideal == [100.0, 200.0, 400.0]
    assert scan.table() == (
        "workers     samples/s  speedup  efficiency\n"
        "      1         100.0    1.00x        100%\n"
        "      2         150.0    1.50x         75%\n"
        "      4         200.0    2.00x         50%"
    )


def test_scan_from_a_count_above_one():
    scan = ScanResult(workers=(2, 4), runs=(), throughput=(100.0, 180.0), unit="samples/s")
    assert scan.efficiency == pytest.approx([1.0, 0.9])


def test_run_scan_runs_each_count_then_shows_figure_and_table():
    walls = {1: 2.0, 2: 1.25}
    shown, printed, ran = [], [], []

    def run(n):
        ran.append(n)
        return _run(n, walls[n], samples_per_rank=1000 / n)  # the same 1000 samples in all

    scan = run_scan(run, (1, 2), plot=True, display=lambda *a, **k: shown.append(a[0]),
                    out=printed.append)  # fmt: skip
    assert ran == [1, 2]
    assert scan.throughput == (500.0, 800.0) and scan.unit == "samples/s"
    assert scan.efficiency == [1.0, 0.8]
    assert printed[:2] == ["nbdist: scan: 1 worker", "nbdist: scan: 2 workers"]
    assert printed[2] == scan.table()
    assert shown[0]["text/plain"] == "<nbdist scan: throughput vs workers>"
    assert base64.b64decode(shown[0]["image/png"]).startswith(b"\x89PNG")


def test_without_samples_speedup_is_a_ratio_of_wall_times():
    walls = {1: 2.0, 2: 1.6}
    scan = run_scan(lambda n: _run(n, walls[n]), (1, 2), plot=False, display=None,
                    out=lambda s: None)  # fmt: skip
    assert scan.unit == "runs/s"
    assert scan.speedup == [1.0, 1.25]


def test_a_profiled_scan_shows_where_the_step_goes():
    from nbdist.kernel.breakdown import ProfileReport, RankProfile
    from nbdist.kernel.result import DistrainResult

    def run(*ranks):
        profile = ProfileReport(
            ranks=tuple(
                RankProfile(rank=i, steps=3, step_ms=10.0, compute_ms=c, communication_ms=m,
                            overlapped_ms=0.0, waiting_ms=w, other_ms=10.0 - c - m - w)
                for i, (c, m, w) in enumerate(ranks)
            ),
            device="cpu", folder=None, skipped=2,
        )  # fmt: skip
        return DistrainResult(framework="torch", world_size=len(ranks), wall=1.0, ranks=(),
                              profile=profile)  # fmt: skip

    scan = ScanResult(
        workers=(1, 2), runs=(run((9, 0, 0)), run((6, 2, 1), (5, 2, 2))),
        throughput=(100.0, 150.0), unit="samples/s",
    )  # fmt: skip
    assert scan.table() == (
        "workers     samples/s  speedup  efficiency  compute   comm  waiting  other\n"
        "      1         100.0    1.00x        100%      90%     0%       0%    10%\n"
        "      2         150.0    1.50x         75%      55%    20%      15%    10%"
    )
