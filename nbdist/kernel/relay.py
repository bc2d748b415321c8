"""What the ranks print and display, relayed into the notebook cell.

Ranks print to their own engines; ipyparallel hands the notebook each task's stdout, stderr and
display outputs as they arrive. Printed lines go to the cell prefixed ``[rank N]``; what a rank
``display()``-s (a figure, HTML, a table) is shown as it is, under a ``[rank N]`` label when
more than one rank displayed something.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO


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

    def pump(self, ars: list[Any], final: bool = False) -> None:
        now = time.monotonic()
        for name, sink in self._sinks.items():
            held = self._held[name]
            for rank, ar in enumerate(ars):
                text = getattr(ar, name) or ""
                seen = self._seen[name]
                new, seen[rank] = text[seen[rank] :], len(text)
                if not self.visible[rank] or not (new or final):
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
