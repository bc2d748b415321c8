"""The safety net for cells whose ranks trained alone: independent copies, said once.

A training library that does not see the process group (an older release, a launcher it does
not recognise, a flag that turns it off) makes every rank train its own model on its own data:
the cell succeeds, and nothing says the replicas differ. The workers count what would have
kept them together (``RankReport.steps``: the training steps autolog saw; ``collectives``: the
collectives each rank ran during the cell), and a cell that trained on more than one rank with
no collective on any of them ends with one warning.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from nbdist.protocol import RankReport

# What to say of each library a cell brings, when its ranks trained alone.
_ADVICE = {
    "transformers": "Trainer",
    "accelerate": "Accelerator",
    "lightning": "Fabric / Trainer",
    "pytorch_lightning": "Trainer",
    "keras": "a Keras model built outside strategy.scope()",
}


def independent_copies(reports: Sequence[RankReport], imported: Collection[str]) -> str | None:
    """The warning for a cell whose ranks trained independent copies, or None.

    ``reports`` are the ranks' reports (one per rank of the whole group); ``imported`` the
    packages the cell imports. Silent when a rank ran a collective, when no rank trained, or
    when a backend could not count.
    """
    if len(reports) < 2:
        return None
    counts = [r.collectives for r in reports]
    steps = [r.steps for r in reports]
    if not max(steps) or None in counts or any(counts):
        return None
    per_rank = ", ".join(f"rank {r.rank} {r.steps}" for r in reports)
    loaded = reports[0].libraries
    used = [name for name in _ADVICE if name in imported and name in loaded]
    libraries = ""
    if used:
        names = ", ".join(f"{name} {loaded[name]} ({_ADVICE[name]})" for name in used)
        libraries = (
            f" The cell uses {names}: a library that did not see the process group trains "
            "alone on each rank (the README's Libraries section says what nbdist sets up for "
            "each, and which versions were tested)."
        )
    return (
        "nbdist: warning: the ranks trained independent copies: they ran training steps "
        f"({per_rank}), and no collective (a gradient all-reduce, a broadcast) ran on any rank "
        f"during this cell, so nothing kept their models the same.{libraries} Wrap a torch "
        "model in DistributedDataParallel (or fully_shard), build a Keras model in "
        "strategy.scope(); %distrain compare NAME shows whether the replicas agree."
    )
