"""Beyond 16 ranks on real engines: 17 local engines, torch, gloo. The cell prints rank 0's
lines and a count of the others', every point reaches the history, status groups by host."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

WORLD = 17
CELL = (
    "print(f'hello from {rank}')\n"
    "t = torch.ones(1)\n"
    "for i in range(40):\n"
    "    dist.all_reduce(t)\n"
    "    log(loss=1.0 / (i + 1) + rank, samples=4)\n"
)


@pytest.fixture(scope="module")
def many(shell):
    shell.run_line_magic("distrain", f"start -n {WORLD}")
    yield shell
    shell.run_line_magic("distrain", "stop")


def test_seventeen_ranks_print_rank_0_and_count_the_others(many, capsys):
    many.run_cell_magic("distrain", "--framework torch -o res", CELL)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0\n" in out and "[rank 1]" not in out
    assert (
        "nbdist: 16 other ranks printed 16 lines, not shown here (shown: rank 0); per rank "
        "1 / 1 / 1 (min / median / max), most: rank 1 1, rank 2 1, rank 3 1."
    ) in out
    res = many.user_ns["res"]
    assert res.stdout == [f"hello from {r}\n" for r in range(WORLD)]
    steps = sorted((h["rank"], h["step"]) for h in res.history)
    assert steps == [(r, i) for r in range(WORLD) for i in range(40)]  # no point lost
    assert f"{WORLD} workers (torch)" in out


def test_ranks_all_shows_every_rank(many, capsys):
    many.run_cell_magic("distrain", "--framework torch --ranks all", "print(f'hi {rank}')\n")
    out = capsys.readouterr().out
    assert all(f"[rank {r}] hi {r}\n" in out for r in range(WORLD))
    assert "other ranks printed" not in out


def test_status_groups_by_host(many, capsys):
    many.run_line_magic("distrain", "status")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"nbdist: {WORLD} workers on 1 host")
    assert lines[1].endswith(f"ranks 0-{WORLD - 1}, GPUs none, 0 busy, {WORLD} idle")
    assert "busy ranks: none" in lines
    assert not any(line.startswith("   0 ") for line in lines)  # no line per rank
    assert "memory per host (min / median / max over its ranks):" in lines
    assert any(line.startswith(f"  {lines[1].split()[0]}: {WORLD} ranks, ") for line in lines)
