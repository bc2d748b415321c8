"""The session's line magics: ``%distrain reset | pull | push | vars | compare`` and the
per-rank memory lines of ``%distrain status``. Each runs between cells, on every worker."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from nbdist.engine import backends, session_ops
from nbdist.kernel.engines import gather, remote_message
from nbdist.kernel.export import CellRecord
from nbdist.kernel.prepare import check_push
from nbdist.kernel.session import Session
from nbdist.protocol import MemoryReport
from nbdist.ranks import MANY_RANKS

COMMAND_TIMEOUT_S = 60.0


def _running(session: Session, what: str) -> None:
    session.ready()
    if not session.cluster.running or not session.cluster.engines:
        raise UsageError(
            f"%distrain {what}: no workers are running; run a %%distrain cell (or "
            "%distrain start) first."
        )
    dead = session.cluster.dead(range(session.cluster.size))
    if dead:
        raise UsageError(
            f"%distrain {what}: {session.cluster.gone_text(dead, when=' after its last cell')}. "
            f"{session.dead_advice()}"
        )


def _on_all(
    session: Session, what: str, fn: Any, *args: Any, ranks: list[int] | None = None
) -> list[Any]:
    """``fn(*args)`` on every rank (or those in ``ranks``), in rank order; a remote error
    becomes a UsageError that names the rank."""
    cluster = session.cluster
    ranks = [e.rank for e in cluster.engines] if ranks is None else ranks
    ars = [cluster.apply_async(r, fn, *args) for r in ranks]

    def late(rank: int) -> UsageError:
        return UsageError(
            f"%distrain {what}: rank {rank} did not answer within {COMMAND_TIMEOUT_S:g} s "
            "(is a cell still running there?); %distrain status shows which rank is busy, "
            "%distrain restart gives fresh workers."
        )

    def failed(rank: int, e: Exception) -> UsageError:
        return UsageError(f"%distrain {what}: rank {rank}: {remote_message(e)}")

    return gather(ranks, ars, COMMAND_TIMEOUT_S, late=late, failed=failed)


MOST_MEMORY = 5  # ranks named beyond MANY_RANKS ranks


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MB"


def reset(session: Session) -> str:
    _running(session, "reset")
    reports = _on_all(session, "reset", session_ops.reset)
    session.forget()
    dropped = sorted({name for r in reports for name in r.dropped})
    memory = ", ".join(f"rank {i} {_mb(r.rss)}" for i, r in enumerate(reports))
    what = f"dropped {', '.join(dropped)}" if dropped else "no variables to drop"
    return f"nbdist: reset: {what} on every worker; memory now {memory}"


def pull(session: Session, names: tuple[str, ...], rank: int, user_ns: dict[str, Any]) -> str:
    _running(session, "pull")
    if not 0 <= rank < session.cluster.size:
        raise UsageError(
            f"%distrain pull: --rank {rank} does not exist; ranks go from 0 to "
            f"{session.cluster.size - 1}."
        )
    try:
        packed = session.cluster.apply_async(rank, session_ops.pull, list(names)).get(
            COMMAND_TIMEOUT_S
        )
        values = packed.unpack(" in the notebook")
    except Exception as e:
        raise UsageError(f"%distrain pull: rank {rank}: {remote_message(e)}") from None
    user_ns.update(values)
    said = f"nbdist: pulled {', '.join(names)} from rank {rank}"
    if packed.unwrapped:
        which = ", ".join(packed.unwrapped)
        one = len(packed.unwrapped) == 1
        said += (
            f" ({which} {'is a' if one else 'are'} DistributedDataParallel "
            f"model{'' if one else 's'} on the workers: the notebook has no process group, so "
            f"it got the module{'' if one else 's'} {'it wraps' if one else 'they wrap'})"
        )
    return said


def push(session: Session, names: tuple[str, ...], user_ns: dict[str, Any]) -> str:
    values, packed = check_push(names, user_ns, flag="%distrain push")
    _running(session, "push")
    _on_all(session, "push", session_ops.push, packed)
    session.variables = sorted({*session.variables, *names})
    session.cells.append(
        CellRecord(
            source="",
            kind="push",
            push=values,
            framework=session.framework or backends.frameworks()[0],
            world_size=session.cluster.size,
            autolog=False,
        )  # fmt: skip
    )
    return f"nbdist: pushed {', '.join(names)} to every worker"


def sync(session: Session, names: tuple[str, ...], source: int) -> str:
    """``%distrain sync NAME[,NAME] [--from R]``: every other rank takes rank ``source``'s
    ``names`` (models and optimizers in place, anything else replaced)."""
    _running(session, "sync")
    size = session.cluster.size
    if not 0 <= source < size:
        raise UsageError(
            f"%distrain sync: --from {source} does not exist; ranks go from 0 to {size - 1}."
        )
    try:
        data = session.cluster.apply_async(source, session_ops.states, list(names)).get(
            COMMAND_TIMEOUT_S
        )
    except Exception as e:
        raise UsageError(f"%distrain sync: rank {source}: {remote_message(e)}") from None
    others = [r for r in range(size) if r != source]
    in_place = _on_all(session, "sync", session_ops.take, data, ranks=others)
    loaded = sorted(set(in_place[0])) if in_place else []
    how = f" ({', '.join(loaded)} loaded in place)" if loaded else ""
    return f"nbdist: every rank has rank {source}'s {', '.join(names)} now{how}"


def variables(session: Session) -> Any:
    from nbdist.kernel.compare import vars_table

    _running(session, "vars")
    return vars_table(_on_all(session, "vars", session_ops.describe_all))


def compare(session: Session, name: str) -> Any:
    from nbdist.kernel.compare import compare as compare_leaves

    _running(session, "compare")
    flats = _on_all(session, "compare", session_ops.flatten, name)
    if all(f is None for f in flats):
        raise UsageError(
            f"%distrain compare: no variable {name!r} on any worker; %distrain vars lists them."
        )
    return compare_leaves(name, [{} if f is None else f for f in flats])


def status_lines(session: Session) -> list[str]:
    """Each rank's memory, its GPUs and how many variables it holds."""
    if not session.cluster.running or not session.cluster.engines:
        return []
    if session.cluster.dead(range(session.cluster.size)):
        return []  # the status table says which, and what to do
    try:
        reports = _on_all(session, "status", session_ops.memory)
    except UsageError as e:  # a busy or dead engine: status still shows the rest
        return [f"memory: not available ({e})"]
    if len(reports) > MANY_RANKS:
        return host_memory_lines(reports, [e.host for e in session.cluster.engines])
    return memory_lines(reports)


def host_memory_lines(reports: list[MemoryReport], hosts: list[str]) -> list[str]:
    """``%distrain status`` beyond ``MANY_RANKS`` ranks: memory and variables per host
    (min / median / max over its ranks), then the ranks using the most memory."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts[: len(reports)]):
        groups.setdefault(host, []).append(rank)
    lines = ["memory per host (min / median / max over its ranks):"]
    for host, ranks in groups.items():
        rss = sorted(reports[r].rss for r in ranks)
        var = sorted(reports[r].variables for r in ranks)
        mid = (len(ranks) - 1) // 2
        lines.append(
            f"  {host}: {len(ranks)} ranks, {_mb(rss[0])} / {_mb(rss[mid])} / {_mb(rss[-1])}, "
            f"variables {var[0]} / {var[mid]} / {var[-1]}"
        )
    most = sorted(range(len(reports)), key=lambda r: (-reports[r].rss, r))[:MOST_MEMORY]
    lines.append("most memory: " + ", ".join(f"rank {r} {_mb(reports[r].rss)}" for r in most))
    return lines


def memory_lines(reports: list[MemoryReport]) -> list[str]:
    """The per-rank lines of ``%distrain status`` from each rank's ``session_ops.memory()``:
    with GPUs, a last column names each rank's GPU and the memory in use on it."""
    head = f"{'rank':>4}  {'memory':>9}  {'gpu memory':>10}  variables"
    rows = [
        f"{rank:>4}  {_mb(r.rss):>9}  {_mb(r.gpu):>10}  {r.variables}"
        for rank, r in enumerate(reports)
    ]
    if not any(r.gpus for r in reports):
        return [head, *rows]
    width = max(len(line) for line in (head, *rows))
    gpus = ["; ".join(_gpu_text(g) for g in r.gpus) or "-" for r in reports]
    return [f"{head:<{width}}  gpu"] + [
        f"{row:<{width}}  {gpu}" for row, gpu in zip(rows, gpus, strict=True)
    ]


def _gpu_text(g: dict[str, Any]) -> str:
    used, total = g["used_mib"], g["total_mib"]
    memory = f"{used:,} of {total:,} MiB in use" if used is not None and total else "memory n/a"
    return f"{g['id']}: {g['name']}, {memory}"
