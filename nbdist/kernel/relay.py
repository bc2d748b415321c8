"""What the ranks print and display, relayed into the notebook cell.

Ranks print to their own engines; ipyparallel hands the notebook each task's stdout, stderr and
display outputs as they arrive. Printed lines go to the cell prefixed ``[rank N]``; what a rank
``display()``-s (a figure, HTML, a table) is shown as it is, under a ``[rank N]`` label when
more than one rank displayed something. Beyond ``PER_RANK_MAX`` ranks only the first rank's
lines are shown unless ``--ranks`` says otherwise (512 ranks printing a line a second would
bury the cell), and the end of the cell says how many lines the others printed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from nbdist.kernel.curves import PER_RANK_MAX

MOST_LISTED = 3  # ranks named in the note on lines not shown


class OutputRelay:
    """Forwards the ranks' new stdout/stderr lines to the cell, prefixed ``[rank N]``.

    Lines are held for up to ``HOLD_S`` and a burst is written in rank order, so lines that ranks
    print at about the same time (after a collective, say) read ``[rank 0]``, ``[rank 1]``, ...
    instead of in whichever order the messages happened to arrive.
    """

    HOLD_S = 0.3

    def __init__(
        self,
        visible: list[bool],
        out: TextIO,
        err: TextIO,
        labels: Sequence[int] | None = None,
        noise: str | None = None,
    ) -> None:
        self.visible = visible
        self._noise = re.compile(noise) if noise else None
        self.labels = list(labels) if labels is not None else list(range(len(visible)))
        self._sinks = {"stdout": out, "stderr": err}
        n = len(visible)
        self._seen = {name: [0] * n for name in self._sinks}
        self._partial = {name: [""] * n for name in self._sinks}
        self._held: dict[str, list[tuple[int, str]]] = {name: [] for name in self._sinks}
        self._since: dict[str, float] = {}
        self.note_hidden = False
        self.hidden = [0] * n  # lines of ranks not shown, per rank (stdout and stderr)

    @classmethod
    def for_job(
        cls, ranks: Sequence[int], opts: Any, out: TextIO, err: TextIO, noise: str | None = None
    ) -> OutputRelay:
        """The relay for a job on session ranks ``ranks``: the ranks ``--ranks`` names; without
        it every rank up to ``PER_RANK_MAX`` ranks, beyond that the first one only and a count
        of the others' lines at the end; ``--ranks all`` every rank however many."""
        chosen = opts.ranks
        many = chosen is None and len(ranks) > PER_RANK_MAX and not opts.all_output
        if many:
            visible = [i == 0 for i in range(len(ranks))]
        else:
            visible = [chosen is None or r in chosen for r in ranks]
        relay = cls(visible, out, err, labels=ranks, noise=noise)
        relay.note_hidden = many
        return relay

    def hidden_note(self) -> str | None:
        """What the ranks not shown printed, in one line; None when they printed nothing."""
        counts = [(c, self.labels[i]) for i, c in enumerate(self.hidden) if not self.visible[i]]
        total = sum(c for c, _ in counts)
        if not total:
            return None
        per_rank = sorted(c for c, _ in counts)
        mid = per_rank[(len(per_rank) - 1) // 2]
        most = sorted(counts, key=lambda cr: (-cr[0], cr[1]))[:MOST_LISTED]
        named = ", ".join(f"rank {r} {c:,}" for c, r in most if c)
        shown = ", ".join(str(self.labels[i]) for i, v in enumerate(self.visible) if v)
        return (
            f"nbdist: {len(counts)} other ranks printed {total:,} lines, not shown here (shown: "
            f"rank {shown}); per rank {per_rank[0]:,} / {mid:,} / {per_rank[-1]:,} (min / "
            f"median / max), most: {named}. `--ranks all` shows every rank's lines, `--ranks 3,5` "
            "some; all are kept in the result (`-o res`, then `res.stdout[rank]`)."
        )

    def pump(
        self, ars: list[Any], final: bool = False, positions: Iterable[int] | None = None
    ) -> None:
        """Take in the new lines of the tasks at ``positions`` (all by default, and at the end)."""
        now = time.monotonic()
        due = range(len(ars)) if final or positions is None else list(positions)
        for name, sink in self._sinks.items():
            held = self._held[name]
            for rank in due:
                ar = ars[rank]
                text = getattr(ar, name) or ""
                seen = self._seen[name]
                new, seen[rank] = text[seen[rank] :], len(text)
                if not self.visible[rank]:
                    self.hidden[rank] += new.count("\n")
                    if final and text and not text.endswith("\n"):  # a last line, unfinished
                        self.hidden[rank] += 1
                    continue
                if not (new or final):
                    continue
                lines = (self._partial[name][rank] + new).split("\n")
                self._partial[name][rank] = "" if final else lines.pop()
                if self._noise is not None:
                    lines = [ln for ln in lines if not self._noise.match(ln)]
                held.extend((rank, line) for line in lines if line or not final)
            if held:
                self._since.setdefault(name, now)
            if held and (final or now - self._since[name] >= self.HOLD_S):
                held.sort(key=lambda item: item[0])  # stable: each rank's lines stay in order
                labels = self.labels
                sink.write("".join(f"[rank {labels[i]}] {line}\n" for i, line in held))
                sink.flush()
                held.clear()
                del self._since[name]
        if final and self.note_hidden and (note := self.hidden_note()):
            self.note_hidden = False  # once
            self._sinks["stdout"].write(note + "\n")
            self._sinks["stdout"].flush()


def show_displays(ars: Sequence[Any], labels: Sequence[int], publish: Callable[..., Any]) -> int:
    """Show what each rank displayed, in rank order; returns how many outputs were shown.

    They are shown once the job ends, all together, so that their order and labels do not
    depend on message timing (nbval compares them).
    """
    per_rank = [
        (label, list(getattr(ar, "outputs", None) or []))
        for label, ar in zip(labels, ars, strict=True)
    ]
    showing = [(label, outs) for label, outs in per_rank if outs]
    shown = 0
    for label, outputs in showing:
        if len(showing) > 1:
            publish({"text/plain": f"[rank {label}]"}, {})
        for out in outputs:
            publish(out.get("data", {}), out.get("metadata", {}))
            shown += 1
    return shown
