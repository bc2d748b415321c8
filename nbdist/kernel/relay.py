"""What the ranks print and display, relayed into the notebook cell.

Ranks print to their own engines; ipyparallel hands the notebook each task's stdout, stderr and
display outputs as they arrive. The relay turns them into what plain Jupyter would show for one
process, per rank:

* **Finished lines** go to the cell prefixed ``[rank N]``, as the line looks once written:
  carriage returns and backspaces overwrite what they belong to (Keras' ``verbose=1`` ends each
  epoch on its final ``32/32`` line). ipyparallel already folds a line rewritten after ``\\r``
  into its last version, in the text it keeps; the relay reads the lines that text finished.
* **The line a rank is still writing** (a progress bar: tqdm, Keras, transformers) is shown as it
  changes, one line per rank, in one display updated in place (:class:`ProgressLines`), and
  goes to the cell's text once finished.
* **The same line from several ranks** on stderr (a warning, a log line) is written once, with
  the ranks named (``[ranks 0,1]``). Lines are compared with their memory addresses left out.
  A line waits for the other ranks' copies for up to ``MERGE_S``: ranks in step print the same
  warning within milliseconds; the wait makes the merge independent of message timing. Printed
  output (stdout) stays one line per rank: ranks often print the same thing on purpose.
* A burst of lines on stdout is written in rank order (held ``HOLD_S``).

What a rank ``display()``-s (a figure, HTML, a table) is shown as it is when the job ends,
under a ``[rank N]`` label when more than one rank displayed something. Beyond ``MANY_RANKS``
ranks only the first rank's lines are shown unless ``--ranks`` says otherwise (512 ranks
printing a line a second would bury the cell), and the end of the cell says how many lines the
others printed.
"""

from __future__ import annotations

import html
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from nbdist.ranks import MANY_RANKS

MOST_LISTED = 3  # ranks named in the note on lines not shown
ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def visible(line: str) -> str:
    """A finished line as Jupyter shows it: what follows its last carriage return (one right
    before the newline rewrites nothing), each backspace taking the character before it."""
    line = line.rstrip("\r")
    line = line[line.rfind("\r") + 1 :]
    if "\b" in line:
        out: list[str] = []
        for ch in line:
            if ch == "\b":
                if out:
                    out.pop()
            else:
                out.append(ch)
        line = "".join(out)
    return line


def without_addresses(text: str) -> str:
    """``<History object at 0x7fcf...>`` and its copy on another rank, made comparable."""
    return ADDRESS.sub("0x…", text)


def ranks_label(ranks: Sequence[int]) -> str:
    """``[rank 3]``, ``[ranks 0,1]``, ``[ranks 0-7,9]`` (a span from three ranks on)."""
    if len(ranks) == 1:
        return f"[rank {ranks[0]}]"
    spans: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(
            str(start)
            if start == prev
            else f"{start},{prev}"
            if prev == start + 1
            else f"{start}-{prev}"
        )
        if r is not None:
            start = prev = r
    return f"[ranks {','.join(spans)}]"


class RankText:
    """One rank's stream, as the text the client keeps of it grows: the lines finished since
    the last look, and the line being written now.

    Finished lines are counted, not located by offset: the client folds a line rewritten after
    a carriage return when a later message holds one, and that may shorten a line already
    finished (its ``\r`` arrived at the end of one message, what overwrote it in the next),
    which moves everything after it. Folding never removes a newline.
    """

    def __init__(self) -> None:
        self.lines = 0  # finished lines already taken

    def take(self, text: str) -> tuple[list[str], str]:
        total = text.count("\n")
        new = total - self.lines
        if new <= 0:
            return [], text[text.rfind("\n") + 1 :]
        parts = text.split("\n") if self.lines == 0 else text.rsplit("\n", new + 1)[1:]
        self.lines = total
        return parts[:-1], parts[-1]


@dataclass
class _Merged:
    """One stderr line and the ranks that wrote it, waiting for the others."""

    key: str
    text: str
    ranks: list[int]
    since: float


@dataclass
class ProgressLines:
    """The line each rank is still writing, shown in one display that is updated in place.

    It appears once a rank has left a line unfinished for ``SHOW_AFTER_S`` (a line finished at
    once never shows here), is redrawn at most every ``REDRAW_S``, and is emptied when no rank
    has an unfinished line any more: the finished lines are in the cell's text by then.
    """

    display: Callable[..., Any]
    SHOW_AFTER_S = 0.3
    REDRAW_S = 0.2
    current: dict[int, tuple[str, float]] = field(default_factory=dict)  # rank -> (text, since)
    display_id: str | None = None
    shown: str | None = None
    _drawn_at: float = 0.0

    def set(self, label: int, text: str, now: float) -> None:
        if not text:
            self.current.pop(label, None)
        elif label not in self.current or self.current[label][0] != text:
            since = self.current[label][1] if label in self.current else now
            self.current[label] = (text, since)

    def draw(self, now: float, *, final: bool = False) -> None:
        due = {r: t for r, (t, since) in self.current.items() if now - since >= self.SHOW_AFTER_S}
        if final:
            due = {}
        text = "\n".join(f"[rank {r}] {t}" for r, t in sorted(due.items()))
        if text == (self.shown or "") or (not final and now - self._drawn_at < self.REDRAW_S):
            return
        if self.display_id is None and not text:
            return
        bundle = {"text/plain": text}
        if text:
            bundle["text/html"] = f"<pre>{html.escape(text)}</pre>"
        if self.display_id is None:
            self.display_id = uuid.uuid4().hex
            self.display(bundle, raw=True, display_id=self.display_id)
        else:
            self.display(bundle, raw=True, display_id=self.display_id, update=True)
        self.shown, self._drawn_at = text, now


class OutputRelay:
    """Forwards the ranks' output to the cell (see the module docstring)."""

    HOLD_S = 0.3
    MERGE_S = 1.0

    def __init__(
        self,
        visible: list[bool],
        out: TextIO,
        err: TextIO,
        labels: Sequence[int] | None = None,
        noise: str | None = None,
        display: Callable[..., Any] | None = None,
    ) -> None:
        self.visible = visible
        self._noise = re.compile(noise) if noise else None
        self.labels = list(labels) if labels is not None else list(range(len(visible)))
        self._sinks = {"stdout": out, "stderr": err}
        n = len(visible)
        self._text = {name: [RankText() for _ in range(n)] for name in self._sinks}
        self._partial = {name: [""] * n for name in self._sinks}  # each rank's unfinished line
        self._held: list[tuple[int, str]] = []  # stdout lines, by position
        self._held_since: float | None = None
        self._merging: list[_Merged] = []  # stderr lines, in order of first arrival
        self.progress = ProgressLines(display) if display is not None else None
        self.note_hidden = False
        self.hidden = [0] * n  # lines of ranks not shown, per rank (stdout and stderr)
        self._live: dict[int, tuple[Any, Any]] = {}  # id(task) -> (task, its live metadata)

    @classmethod
    def for_job(
        cls,
        ranks: Sequence[int],
        opts: Any,
        out: TextIO,
        err: TextIO,
        noise: str | None = None,
        display: Callable[..., Any] | None = None,
    ) -> OutputRelay:
        """The relay for a job on session ranks ``ranks``: the ranks ``--ranks`` names; without
        it every rank up to ``MANY_RANKS`` ranks, beyond that the first one only and a count
        of the others' lines at the end; ``--ranks all`` every rank however many."""
        chosen = opts.ranks
        many = chosen is None and len(ranks) > MANY_RANKS and not opts.all_output
        if many:
            visible = [i == 0 for i in range(len(ranks))]
        else:
            visible = [chosen is None or r in chosen for r in ranks]
        relay = cls(visible, out, err, labels=ranks, noise=noise, display=display)
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
        """Take in the new output of the tasks at ``positions`` (all by default, and at the
        end)."""
        now = time.monotonic()
        due = range(len(ars)) if final or positions is None else list(positions)
        for name in self._sinks:
            for pos in due:
                text = self._stream(ars[pos], name) or ""
                lines, partial = self._text[name][pos].take(text)
                if final and partial:
                    lines, partial = [*lines, partial], ""
                if not self.visible[pos]:
                    self.hidden[pos] += len(lines)
                    continue
                lines = [visible(line) for line in lines]
                if self._noise is not None:
                    lines = [ln for ln in lines if not self._noise.match(ln)]
                if name == "stdout":
                    self._hold(pos, lines, now)
                else:
                    self._merge(pos, lines, now)
                self._partial[name][pos] = visible(partial)
        self._flush_stdout(now, final)
        self._flush_stderr(now, final)
        if self.progress is not None:
            for pos in due:
                if self.visible[pos]:
                    # A progress bar writes to one stream (tqdm to stderr, Keras to stdout).
                    text = self._partial["stderr"][pos] or self._partial["stdout"][pos]
                    self.progress.set(self.labels[pos], text, now)
            self.progress.draw(now, final=final)
        if final and self.note_hidden and (note := self.hidden_note()):
            self.note_hidden = False  # once
            self._write("stdout", note + "\n")

    def _stream(self, ar: Any, name: str) -> str | None:
        """What task ``ar`` wrote to stream ``name`` so far. An ipyparallel task's metadata is
        one dict its client updates in place as output arrives: read there, not through
        ``ar.stdout``, which waits, and parses the metadata's dates, at every read (most of
        what the relay cost a short cell: 0.9 ms)."""
        seen = self._live.get(id(ar))
        if seen is None or seen[0] is not ar:
            metadata = getattr(ar, "metadata", None) if hasattr(type(ar), "metadata") else None
            seen = self._live[id(ar)] = (ar, metadata if isinstance(metadata, dict) else None)
        live = seen[1]
        return live.get(name) if live is not None else getattr(ar, name)

    def _hold(self, pos: int, lines: list[str], now: float) -> None:
        if lines:
            self._held.extend((pos, line) for line in lines)
            if self._held_since is None:
                self._held_since = now

    def _merge(self, pos: int, lines: list[str], now: float) -> None:
        label = self.labels[pos]
        for line in lines:
            key = without_addresses(line)
            for entry in self._merging:
                if entry.key == key and label not in entry.ranks:
                    entry.ranks.append(label)
                    break
            else:
                self._merging.append(_Merged(key, line, [label], now))

    def _flush_stdout(self, now: float, final: bool) -> None:
        if not self._held or self._held_since is None:
            return
        if not (final or now - self._held_since >= self.HOLD_S):
            return
        self._held.sort(key=lambda item: item[0])  # stable: each rank's lines stay in order
        labels = self.labels
        self._write("stdout", "".join(f"[rank {labels[p]}] {line}\n" for p, line in self._held))
        self._held, self._held_since = [], None

    def _flush_stderr(self, now: float, final: bool) -> None:
        everyone = sum(self.visible)
        out = []
        # In order: a line waiting for the other ranks' copies holds back the lines after it.
        while self._merging:
            entry = self._merging[0]
            if not (final or len(entry.ranks) >= everyone or now - entry.since >= self.MERGE_S):
                break
            out.append(f"{ranks_label(entry.ranks)} {entry.text}\n")
            self._merging.pop(0)
        if out:
            self._write("stderr", "".join(out))

    def _write(self, name: str, text: str) -> None:
        sink = self._sinks[name]
        sink.write(text)
        sink.flush()


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
