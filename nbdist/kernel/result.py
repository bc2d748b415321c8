"""What a finished ``%%distrain`` run gives back to the notebook (``-o NAME``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankResult:
    """One rank's share of the result: the cell's last expression, its time and its output."""

    rank: int
    host: str
    value: Any
    value_repr: str | None
    wall: float
    stdout: str
    stderr: str


@dataclass(frozen=True)
class DistrainResult:
    """The result of one ``%%distrain`` run.

    Attributes
    ----------
    framework : str
        ``"torch"`` or ``"tf"``.
    world_size : int
        Number of workers.
    wall : float
        Seconds from submitting the cell to the last rank finishing.
    ranks : tuple of RankResult
        Per-rank value of the cell's last expression (``None`` if it had none or it could not be
        pickled; ``value_repr`` always holds its repr), wall time and stdout/stderr.
    history : tuple of dict
        Every metric point of every rank, in arrival order: ``{"rank", "step", "time", <metric>:
        value, ...}`` (``log(...)`` calls and automatic capture). ``pandas.DataFrame(r.history)``
        makes a table of it.
    warnings : tuple of str
        What nbdist warned about after the run (ranks that trained independent copies).
    profile : ProfileReport or None
        ``--profile``'s breakdown of the step time per rank (``nbdist.kernel.breakdown``).
    """

    framework: str
    world_size: int
    wall: float
    ranks: tuple[RankResult, ...]
    history: tuple[dict[str, Any], ...] = ()
    warnings: tuple[str, ...] = ()
    profile: Any = None

    @property
    def values(self) -> list[Any]:
        """The cell's last-expression value on each rank, in rank order."""
        return [r.value for r in self.ranks]

    @property
    def stdout(self) -> list[str]:
        """Each rank's stdout, in rank order."""
        return [r.stdout for r in self.ranks]

    def __repr__(self) -> str:
        walls = ", ".join(f"{r.wall:.2f}" for r in self.ranks)
        return (
            f"<DistrainResult {self.framework} x{self.world_size}: wall {self.wall:.2f} s "
            f"(per rank: {walls})>"
        )


class PerRank(list):
    """A cell's last value when the ranks' values differ: one entry per rank, in rank order.

    It is a list (``_[1]`` is rank 1's value) that shows as one labelled line per rank.
    """

    def __init__(self, values: list[Any], ranks: list[int]) -> None:
        super().__init__(values)
        self.ranks = list(ranks)

    def __repr__(self) -> str:
        return "\n".join(f"[rank {r}] {v!r}" for r, v in zip(self.ranks, self, strict=True))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))
