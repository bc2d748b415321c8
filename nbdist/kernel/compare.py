"""Are my replicas in sync? ``%distrain compare NAME`` and the ``%distrain vars`` table.

Both are built in the kernel from what each rank sent: ``compare`` from every rank's
``nbdist.engine.inspect.flatten(value)``, ``vars_table`` from every rank's list of
``describe(name, value)`` rows. Every rank is compared against rank 0, the rank whose state DDP
broadcasts at construction and the one a checkpoint is usually written from.

"Identical" means bit-exact up to two IEEE details: NaN equals NaN at the same position (a
diverged loss on every rank is still "in sync"), and -0.0 equals 0.0.
"""

from __future__ import annotations

import cmath
import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_MISSING = object()
_MAX_LISTED = 10  # differences a repr lists before "... and N more"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _label(name: str, entry: str) -> str:
    """``model`` + ``weight`` → ``model.weight``; ``x`` + ``[0]`` → ``x[0]``; ``""`` → ``x``."""
    return f"{name}{entry}" if not entry or entry.startswith("[") else f"{name}.{entry}"


def _short(value: Any, width: int = 30) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _fmt_diff(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1e}"


@dataclass(frozen=True)
class Difference:
    """One entry that is not the same on every rank.

    Attributes
    ----------
    entry : str
        The path of the entry inside the variable (``"weight"``, ``"['lr']"``, ``"[0]"``; ``""``
        for the variable itself), as ``flatten`` names it.
    ranks : tuple of int
        The ranks whose value differs from rank 0's.
    max_abs_diff : float
        The largest absolute difference from rank 0 over those ranks; ``inf`` where the entry is
        missing, or its type, shape or dtype differs, or two strings differ.
    detail : str
        What differs, e.g. ``"shape (3,) on rank 0, (4,) on rank 1"``, ``"missing on rank 1"``,
        ``"max |diff| 2.4e-03"``.
    """

    entry: str
    ranks: tuple[int, ...]
    max_abs_diff: float
    detail: str


@dataclass(frozen=True)
class CompareResult:
    """The result of ``x = %distrain compare NAME``; true when the variable is identical.

    Attributes
    ----------
    name : str
        The variable compared.
    world_size : int
        Number of ranks compared.
    identical : bool
        Every entry is equal on every rank (bit-exact; NaN == NaN, -0.0 == 0.0).
    max_abs_diff : float
        The largest difference over all entries and ranks: ``0.0`` when identical, ``inf`` when
        some entry is missing or mismatched in type, shape or dtype.
    entries : int
        Number of entries compared (the union over ranks).
    differences : tuple of Difference
        The entries that differ, in the variable's order.
    """

    name: str
    world_size: int
    identical: bool
    max_abs_diff: float
    entries: int
    differences: tuple[Difference, ...]

    def __bool__(self) -> bool:
        return self.identical

    def _headline(self) -> str:
        if self.identical:
            return (
                f"{self.name}: identical on {self.world_size} "
                f"rank{'s' if self.world_size != 1 else ''} ({_entries(self.entries)})"
            )
        return (
            f"{self.name}: differs across {self.world_size} ranks in "
            f"{len(self.differences)} of {_entries(self.entries)}, "
            f"max |diff| {_fmt_diff(self.max_abs_diff)}"
        )

    def _rows(self) -> list[tuple[str, str, str]]:
        return [
            (_label(self.name, d.entry), ", ".join(map(str, d.ranks)), d.detail)
            for d in self.differences[:_MAX_LISTED]
        ]

    def __repr__(self) -> str:
        if self.identical:
            return self._headline()
        rows = [("entry", "ranks", "what differs"), *self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = [self._headline()]
        lines += [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
        if len(self.differences) > _MAX_LISTED:
            lines.append(f"  ... and {len(self.differences) - _MAX_LISTED} more")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = f"<p><b>{html.escape(self._headline())}</b></p>"
        if self.identical:
            return head
        cells = "".join(
            f"<tr><td><code>{html.escape(a)}</code></td><td>{html.escape(b)}</td>"
            f"<td>{html.escape(c)}</td></tr>"
            for a, b, c in self._rows()
        )
        more = len(self.differences) - _MAX_LISTED
        tail = f"<p>... and {more} more</p>" if more > 0 else ""
        return (
            f"{head}<table><thead><tr><th>entry</th><th>ranks</th><th>what differs</th></tr>"
            f"</thead><tbody>{cells}</tbody></table>{tail}"
        )


def _type_name(value: Any) -> str:
    name = type(value).__name__
    return "array" if name == "ndarray" else name


def _scalar_diff(a: Any, b: Any) -> float:
    """|a - b| for two Python numbers of one type; NaN == NaN; unequal ints differ by >= 1."""
    if a == b:
        return 0.0
    if isinstance(a, (float, complex)):
        isnan: Callable[[Any], bool] = cmath.isnan if isinstance(a, complex) else math.isnan
        if isnan(a) and isnan(b):
            return 0.0
        d = abs(a - b)
        return math.inf if math.isnan(d) else float(d)
    try:
        return float(abs(int(a) - int(b)))
    except OverflowError:  # two ints too far apart for a float
        return math.inf


def _array_diff(a: Any, b: Any) -> float:
    """Max |a - b| over two numpy arrays of one shape and dtype; NaN == NaN position-wise."""
    import numpy as np

    if a.size == 0:
        return 0.0
    kind = a.dtype.kind
    if kind in "biu":
        # Differences in float64: an int8 subtraction would wrap, and two int64s 1 apart can be
        # equal as floats, hence the floor of 1 where they differ.
        unequal = a != b
        if not unequal.any():
            return 0.0
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        return float(np.maximum(d, 1.0)[unequal].max())
    if kind in "fc":
        wide = np.complex128 if kind == "c" else np.float64  # float16 overflows at 65504
        equal = (a == b) | (np.isnan(a) & np.isnan(b))
        if equal.all():
            return 0.0
        with np.errstate(invalid="ignore", over="ignore"):  # NaN - x is meant: it counts as inf
            d = np.abs(a[~equal].astype(wide) - b[~equal].astype(wide))
        return math.inf if np.isnan(d).any() else float(d.max())
    return 0.0 if np.array_equal(a, b) else math.inf


def _one(ref: Any, value: Any) -> tuple[str, str, str, float] | None:
    """How ``value`` differs from rank 0's ``ref``: ``(kind, rank 0's side, this side, diff)``."""
    if ref is _MISSING and value is _MISSING:
        return None
    if ref is _MISSING or value is _MISSING:
        return ("missing", "", "", math.inf)
    if type(ref) is not type(value):
        return ("type", _type_name(ref), _type_name(value), math.inf)
    if type(ref).__module__ == "numpy":
        if ref.shape != value.shape:
            return ("shape", str(ref.shape), str(value.shape), math.inf)
        if ref.dtype != value.dtype:
            return ("dtype", str(ref.dtype), str(value.dtype), math.inf)
        diff = _array_diff(ref, value)
        return None if diff == 0.0 else ("value", "", "", diff)
    if isinstance(ref, (bool, int, float, complex)):
        diff = _scalar_diff(ref, value)
        return None if diff == 0.0 else ("value", "", "", diff)
    try:
        equal = bool(ref == value)
    except Exception:  # an odd leaf whose == raises or is ambiguous: not provably equal
        equal = False
    return None if equal else ("unequal", _short(ref), _short(value), math.inf)


def _detail(found: dict[int, tuple[str, str, str, float]], missing: list[int]) -> str:
    parts = []
    if missing:
        parts.append(f"missing on {_ranks(missing)}")
    by_kind: dict[str, list[tuple[int, str, str, float]]] = {}
    for rank, (kind, ref, mine, diff) in found.items():
        by_kind.setdefault(kind, []).append((rank, ref, mine, diff))
    for kind, items in by_kind.items():
        if kind == "missing":
            continue
        if kind == "value":
            parts.append(f"max |diff| {_fmt_diff(max(d for *_, d in items))}")
            continue
        sides: dict[str, list[int]] = {}
        for rank, _, mine, _ in items:
            sides.setdefault(mine, []).append(rank)
        prefix = f"{kind} " if kind in ("shape", "dtype") else ""
        others = ", ".join(f"{mine} on {_ranks(r)}" for mine, r in sides.items())
        parts.append(f"{prefix}{items[0][1]} on rank 0, {others}")
    return "; ".join(parts)


def compare(name: str, flats: Sequence[dict[str, Any]]) -> CompareResult:
    """Compare one variable across ranks.

    Parameters
    ----------
    name : str
        The variable's name, for the display.
    flats : sequence of dict
        ``flats[r]`` is ``nbdist.engine.inspect.flatten(value)`` on rank ``r``.

    Returns
    -------
    CompareResult
        ``identical``, ``max_abs_diff`` and one ``Difference`` per entry that is missing on some
        rank, or differs from rank 0's in type, shape, dtype or value.

    Raises
    ------
    ValueError
        If ``flats`` is empty.
    """
    if not flats:
        raise ValueError(f"compare {name!r}: no rank sent its entries (flats is empty)")
    keys = dict.fromkeys(k for flat in flats for k in flat)  # rank 0's order, then the others'
    differences = []
    for key in keys:
        ref = flats[0].get(key, _MISSING)
        found = {}
        for rank in range(1, len(flats)):
            mismatch = _one(ref, flats[rank].get(key, _MISSING))
            if mismatch is not None:
                found[rank] = mismatch
        if found:
            missing = [r for r, flat in enumerate(flats) if key not in flat]
            differences.append(
                Difference(
                    entry=key,
                    ranks=tuple(found),
                    max_abs_diff=max(m[3] for m in found.values()),
                    detail=_detail(found, missing),
                )
            )
    return CompareResult(
        name=name,
        world_size=len(flats),
        identical=not differences,
        max_abs_diff=max((d.max_abs_diff for d in differences), default=0.0),
        entries=len(keys),
        differences=tuple(differences),
    )


@dataclass(frozen=True)
class VarsRow:
    """One variable in ``%distrain vars``: what rank 0 (or the first rank holding it) says."""

    name: str
    type: str
    shape: tuple[int | None, ...] | None
    dtype: str | None
    device: str | None
    params: int | None
    same: str  # "yes", "no (differs on rank 1)", "not compared", "only on rank 0"


_COLUMNS = ("name", "type", "shape", "dtype", "device", "params", "same on every rank")


def _cells(row: VarsRow) -> tuple[str, ...]:
    shape = "" if row.shape is None else "(" + ", ".join(map(str, row.shape)) + ")"
    params = "" if row.params is None else f"{row.params:,}"
    return (row.name, row.type, shape, row.dtype or "", row.device or "", params, row.same)


@dataclass(frozen=True)
class VarsTable:
    """The workers' variables, one row per name, and whether each is the same on every rank."""

    world_size: int
    rows: tuple[VarsRow, ...]

    def __repr__(self) -> str:
        if not self.rows:
            return "no variables on the workers"
        table = [_COLUMNS, *(_cells(r) for r in self.rows)]
        widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
            for line in table
        )

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>no variables on the workers</p>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in _COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(r)) + "</tr>"
            for r in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _same(rows: dict[int, dict[str, Any]], world_size: int) -> str:
    if len(rows) < world_size:
        return f"only on {_ranks(sorted(rows))}"
    if not all(row.get("comparable", False) for row in rows.values()):
        return "not compared"
    ref = rows[0]
    differ = [
        r
        for r, row in rows.items()
        if row.get("digest") != ref.get("digest") or row.get("type") != ref.get("type")
    ]
    return f"no (differs on {_ranks(differ)})" if differ else "yes"


def vars_table(per_rank: Sequence[Sequence[dict[str, Any]]]) -> VarsTable:
    """Build the ``%distrain vars`` table from each rank's ``describe`` rows.

    Parameters
    ----------
    per_rank : sequence of sequence of dict
        ``per_rank[r]`` is rank ``r``'s list of ``nbdist.engine.inspect.describe(name, value)``.

    Returns
    -------
    VarsTable
        One ``VarsRow`` per variable name, sorted by name. The facts (type, shape, ...) are the
        first holding rank's; ``same`` says ``"yes"`` when every rank's digest (and type) equals
        rank 0's, ``"no (differs on rank 1)"``, ``"not compared"`` when some rank could not
        flatten the value, or ``"only on rank 0"`` when some rank lacks it.
    """
    by_name: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            by_name.setdefault(row["name"], {})[rank] = row
    table = []
    for name in sorted(by_name):
        of_rank = by_name[name]
        first = of_rank[min(of_rank)]
        table.append(
            VarsRow(
                name=name,
                type=first.get("type", ""),
                shape=first.get("shape"),
                dtype=first.get("dtype"),
                device=first.get("device"),
                params=first.get("params"),
                same=_same(of_rank, len(per_rank)),
            )
        )
    return VarsTable(world_size=len(per_rank), rows=tuple(table))
