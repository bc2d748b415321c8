"""--profile's breakdown (nbdist.kernel.breakdown) on windows written by hand: every instant of
a step is counted once, and a collective's wait for a slower peer is split from its transfer."""

from __future__ import annotations

import gzip
import json
import os
import stat

import pytest

from nbdist.kernel.breakdown import (
    analyse,
    from_reports,
    intersect,
    merge,
    subtract,
    timeline_png,
    trace_events,
    write_traces,
)


def test_interval_arithmetic():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert subtract([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]


def _window(steps, compute, comm):
    return {"device": "cpu", "steps": steps, "compute": compute, "comm": comm, "top": []}


def test_a_fast_rank_waits_for_a_slow_one():
    """Two 100 ms steps (µs in the windows). Rank 1 computes 80 ms a step, rank 0 20 ms; each
    step's all-reduce ends at the same moment on both, and takes rank 1 (the last to arrive)
    5 ms: rank 0's 65 ms in it before that are waiting."""
    fast = _window(
        steps=[(0, 100_000), (100_000, 200_000)],
        compute=[(0, 20_000), (100_000, 120_000)],
        comm=[("gloo:all_reduce", 20_000, 90_000), ("gloo:all_reduce", 120_000, 190_000)],
    )
    slow = _window(
        steps=[(0, 100_000), (100_000, 200_000)],
        compute=[(0, 85_000), (100_000, 185_000)],
        comm=[("gloo:all_reduce", 85_000, 90_000), ("gloo:all_reduce", 185_000, 190_000)],
    )
    report = analyse({0: fast, 1: slow}, skipped=2)
    r0, r1 = report.ranks
    assert (r0.step_ms, r0.compute_ms, r0.communication_ms, r0.waiting_ms, r0.other_ms) == (
        100.0, 20.0, 5.0, 65.0, 10.0,
    )  # fmt: skip
    assert (r1.step_ms, r1.compute_ms, r1.communication_ms, r1.waiting_ms, r1.other_ms) == (
        100.0, 85.0, 5.0, 0.0, 10.0,
    )  # fmt: skip
    for r in report.ranks:
        assert sum(r.share(p) for p in ("compute", "communication", "waiting", "other")) == 1.0
    assert r0.share("waiting") > r1.share("waiting") and r1.share("compute") > r0.share("compute")
    assert report.notes == ()
    png = timeline_png(report)
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    # What the cell prints: the profiler's dip named, and no line break inside a number.
    text = report.text().splitlines()
    assert text[-1] == (
        "note: the throughput dips over steps 2-3: that is the profiler's own cost while it "
        "records, not the model's"
    )
    from dataclasses import replace

    ops = (("aten::addmm", 0.125, 3.0), ("aten::mm", 0.05, 1.0))
    with_ops = replace(report, ranks=(replace(r0, top_ops=ops), r1))
    assert with_ops.top_text().splitlines()[0] == (
        "  rank 0: aten::addmm\u00a00.1\u00a0ms, aten::mm\u00a00.1\u00a0ms"
    )


def test_overlap_is_part_of_computation_and_counted_once():
    """An all-reduce that runs while the rank still computes (DDP's buckets during backward)."""
    w = _window(
        steps=[(0, 10_000)],
        compute=[(0, 6_000)],
        comm=[("gloo:all_reduce", 4_000, 8_000)],
    )
    (r,) = analyse({0: w}, skipped=2).ranks
    assert (r.compute_ms, r.overlapped_ms, r.communication_ms, r.waiting_ms, r.other_ms) == (
        6.0, 2.0, 2.0, 0.0, 2.0,
    )  # fmt: skip


def test_ranks_that_ran_different_collectives_are_not_split():
    a = _window([(0, 10_000)], [(0, 2_000)], [("gloo:all_reduce", 2_000, 9_000)])
    b = _window([(0, 10_000)], [(0, 8_000)], [])
    report = analyse({0: a, 1: b}, skipped=2)
    assert report.ranks[0].waiting_ms == 0.0 and report.ranks[0].communication_ms == 7.0
    assert "different numbers of collectives" in report.notes[0]


def test_a_rank_with_no_window_says_how_to_get_one():
    report, text = from_reports({0: None, 1: None}, "In3", skipped=2)
    assert report is None
    assert text == (
        "nbdist: --profile: no step was profiled on rank 0: the window opens after 2 optimizer "
        "steps (optimizer.step() calls); run more steps in the cell"
    )
    report, text = from_reports({0: {"error": "OSError: disk full"}}, "In3", skipped=2)
    assert text == "nbdist: --profile: rank 0 could not summarise its profile (OSError: disk full)"


def test_traces_go_to_a_folder_of_this_users(tmp_path, monkeypatch):
    data = gzip.compress(json.dumps({"traceEvents": [{"name": "aten::mm", "ph": "X"}]}).encode())
    folder = write_traces({0: data, 1: data}, "In7", base=str(tmp_path))
    assert os.path.basename(folder).startswith("In7-")  # the cell as IPython names it
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for r in (0, 1):
        path = os.path.join(folder, f"In7-rank{r}.pt.trace.json.gz")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert trace_events(path) == [{"name": "aten::mm", "ph": "X"}]
    # A second cell in the same second gets a folder of its own.
    assert write_traces({0: data}, "In7", base=str(tmp_path)) != folder
    # A link planted where the folder goes (another user's, in a shared folder) is refused.
    other = tmp_path / "elsewhere"
    other.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "nbdist-profile").symlink_to(other)
    with pytest.raises(PermissionError, match="is not a folder of this user's"):
        write_traces({0: data}, "In1", base=str(shared))
    assert list(other.iterdir()) == []
    # A folder of this user's that others may read or write into is refused, and said so.
    (tmp_path / "nbdist-profile").chmod(0o755)
    with pytest.raises(PermissionError, match=r"is open to other users \(mode 755\)"):
        write_traces({0: data}, "In8", base=str(tmp_path))
