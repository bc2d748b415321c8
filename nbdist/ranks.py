"""Ranks in words, the same everywhere: spans (``0-3, 7``), and how many ranks are "many"."""

from __future__ import annotations

from collections.abc import Iterable

# Beyond this many ranks every view changes shape: the panel's table has a row per host, the
# figure a band instead of a line per rank, the cell prints rank 0's lines only, failures and
# status name ranks as spans, and the kernel reads the ranks' messages in turns.
MANY_RANKS = 16


def spans(ranks: Iterable[int]) -> str:
    """``0-3, 7, 9-10`` for ranks 0, 1, 2, 3, 7, 9, 10 (in any order; each once)."""
    ordered = sorted(set(ranks))
    if not ordered:
        return ""
    out: list[str] = []
    start = prev = ordered[0]
    for r in ordered[1:]:
        if r != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = r
        prev = r
    out.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(out)
