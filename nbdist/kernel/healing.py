"""Healing a session after a worker died: the notebook's side (the engines': ``nbdist.engine
.healing``).

A torch session survives a lost rank: the survivors keep their variables, a new engine takes
the dead rank's place, and every rank but one survivor (the lowest) gets that survivor's
variables, so all replicas are equal again; the next cell makes a new group and wraps the DDP
models in it again. What cannot be sent (an open file, a generator, a data loader's iterator)
is named. It is automatic (``%distrain heal off`` turns it off): after a cell in which a rank
died, or before the next cell when a rank died between cells.

Where the new engines come from: a local cluster starts them itself; a connected cluster asks
the launcher ``ipcluster start`` used (its cluster file names it), and where there is none
(engines started by hand, an SSH launcher, which starts all its hosts at once) the engines that
answer go on alone, as fewer ranks, still with their variables.

TensorFlow: a ``MultiWorkerMirroredStrategy`` cannot change its cluster in place, so every
engine is replaced, and each gets a survivor's variables, its Keras models saved whole and
built again in the next cell's new strategy's scope (``_heal_tf``).

Where it cannot heal, the engines are replaced as before and the cell says why: sharded state
(FSDP2: the dead rank's shards died with it), TensorFlow on a connected cluster (only its owner
can restart every engine), no survivor, or nothing to keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbdist.engine import backends, healing
from nbdist.kernel.engines import gather


def interrupt_text(framework: str) -> str:
    """Why the engines of a framework that cannot go on after an interrupt are replaced."""
    return f"an interrupt stopped {backends.load(framework).TITLE}, which cannot go on after one"


HEAL_TIMEOUT_S = 120.0  # the survivors' leave, the snapshot, the new engines, the restores


@dataclass(frozen=True)
class Healed:
    """What a healing did."""

    ranks: tuple[int, ...]  # the ranks that got new engines
    source: int  # the survivor whose variables every other rank got
    sent: tuple[str, ...]
    unsent: dict[str, str]  # name -> what it is and why it could not be sent
    rewrapped: tuple[str, ...]  # DDP models, wrapped again on the next cell's group
    replaced: bool = True  # new engines took the dead ranks (False: the survivors go on alone)
    size: int = 0  # how many ranks the session has after it
    rebuilt: tuple[str, ...] = ()  # TensorFlow: Keras models built again in the new scope
    # TensorFlow: every engine was replaced, not only the dead ones, because its group cannot
    # change its cluster: the framework's name and that group (the backend's TITLE and
    # FIXED_CLUSTER), for the message.
    everyone: tuple[str, str] | None = None
    modules: tuple[str, ...] = ()  # the names of the imports it carried
    samplers: tuple[str, ...] = ()  # DistributedSamplers, each rank's own shard at the next cell

    def text(self) -> str:
        which = ", ".join(map(str, self.ranks))
        rank = "rank" if len(self.ranks) == 1 else "ranks"
        sent = f"rank {self.source}'s variables ({', '.join(self.sent) or 'none'})"
        if self.modules:
            sent += f" and imports ({', '.join(self.modules)})"
        if self.everyone is not None:
            title, group = self.everyone
            line = (
                f"the session was healed as far as {title} allows: a {group} "
                f"cannot change its cluster in place, so new engines took all {self.size} ranks, "
                f"and every rank got {sent}"
            )
        elif self.replaced:
            engines = "a new engine" if len(self.ranks) == 1 else "new engines"
            line = f"the session was healed: {engines} took {rank} {which}, and every rank got "
            line += sent
        else:
            rest = (
                "the one that answers goes on as rank 0"
                if self.size == 1
                else f"the {self.size} that answer go on as ranks 0-{self.size - 1}"
            )
            line = (
                f"the session was healed on fewer ranks: no engine could be started for {rank} "
                f"{which}, so {rest}, and every rank got {sent}"
            )
        if self.rewrapped:
            line += (
                f"; the next cell wraps {', '.join(self.rewrapped)} in "
                "DistributedDataParallel again, on a new process group"
            )
        if self.samplers:
            one = len(self.samplers) == 1
            line += (
                f"; {', '.join(self.samplers)} (DistributedSampler) "
                f"{'reads' if one else 'read'} each rank's own shard again"
            )
        if self.rebuilt:
            line += (
                f"; the next cell builds {', '.join(self.rebuilt)} in its new strategy's scope "
                "(architecture, weights and optimizer state, from a .keras save)"
            )
        line += (
            f". Values the cells computed from the rank (a gpu_id = LOCAL_RANK, a shard of "
            f"your own) are rank {self.source}'s on every rank now: set them again"
        )
        if self.unsent:
            what = ", ".join(f"{n} ({why})" for n, why in sorted(self.unsent.items()))
            line += f". Not sent, re-run the cells that make them: {what}"
        return line + "."


def why_not(
    cluster: Any,
    framework: str | None,
    dead: Sequence[int],
    *,
    variables: bool,
    interrupted: bool = False,
) -> str | None:
    """Why the session cannot be healed after ``dead`` died (None: it can); ``interrupted``:
    in a cell the user interrupted, so the survivors took SIGINT too."""
    if not variables:
        return "the workers held no variables"
    if framework is None:
        return "no framework's session to heal"
    backend = backends.load(framework)
    if backend.NOT_HEALED is not None:
        return str(backend.NOT_HEALED)
    if interrupted and not backend.SURVIVES_INTERRUPT:
        # nothing sound to heal from (the cell replaces every engine)
        return interrupt_text(framework)
    if backend.FIXED_CLUSTER is not None and not cluster.STARTS_ENGINES:
        return (
            f"a {backend.TITLE} {backend.FIXED_CLUSTER} cannot change its cluster in place, and "
            "nbdist does not restart the engines of a connected cluster"
        )
    if len(set(dead)) >= cluster.size:
        return "no rank survived"
    return None


def heal(
    cluster: Any, framework: str, dead: Sequence[int], imports: tuple[str, ...] = ()
) -> Healed:
    """Rebuild the ranks ``dead`` from the lowest surviving rank (see the module's doc);
    ``imports``: the dotted modules the session's cells imported, imported first where the
    session arrives."""
    dead = sorted(set(dead))
    survivors = [r for r in range(cluster.size) if r not in dead]
    backend = backends.load(framework)
    if backend.FIXED_CLUSTER is not None:
        fixed = (backend.TITLE, backend.FIXED_CLUSTER)
        return _heal_every_engine(cluster, dead, survivors[0], imports, fixed)
    rewrap, snap = _leave_and_snapshot(cluster, framework, survivors)
    source_id = cluster.engines[survivors[0]].engine_id
    replaced = cluster.replace_ranks(dead)
    # A connected cluster ranks its engines anew: the survivor may have another rank now.
    source = [e.engine_id for e in cluster.engines].index(source_id)
    others = [r for r in range(cluster.size) if r != source]
    _restore(cluster, others, snap, rewrap, imports)
    return Healed(
        ranks=tuple(dead), source=survivors[0], sent=tuple(snap.sent), unsent=dict(snap.unsent),
        rewrapped=tuple(sorted(rewrap)), replaced=replaced, size=cluster.size,
        modules=tuple(snap.modules), samplers=tuple(snap.samplers),
    )  # fmt: skip


@dataclass(frozen=True)
class Carried:
    """A session kept in the notebook between two sets of engines (a Slurm job's time limit):
    rank 0's variables and imports, and where the DDP models go again."""

    snap: Any  # engine.healing.Snapshot
    rewrap: dict[str, Any]
    imports: tuple[str, ...]

    def text(self) -> str:
        what = ", ".join(self.snap.sent) or "none"
        line = f"the session's variables ({what}) were saved in the notebook"
        if self.snap.unsent:
            line += (
                " (not "
                + ", ".join(f"{n}: {why}" for n, why in sorted(self.snap.unsent.items()))
                + ")"
            )
        return line


def can_carry(framework: str | None) -> bool:
    """Whether a session of ``framework`` can go to the notebook and on to other engines (a
    Slurm job's end): where a healing keeps the survivors' engines (torch)."""
    if framework is None:
        return False
    backend = backends.load(framework)
    return backend.NOT_HEALED is None and backend.FIXED_CLUSTER is None


def carry_out(cluster: Any, framework: str, imports: tuple[str, ...]) -> Carried:
    """Every rank leaves the group (DDP models unwrapped, the variables kept: the next cell on
    these engines wraps them again), and rank 0's session comes to the notebook, as a
    healing's snapshot: :func:`carry_in` gives it to other engines."""
    rewrap, snap = _leave_and_snapshot(cluster, framework, list(range(cluster.size)))
    return Carried(snap=snap, rewrap=rewrap, imports=imports)


def carry_in(cluster: Any, carried: Carried) -> list[str]:
    """Every rank of ``cluster`` takes the carried session (``engine.healing.restore``); the
    next cell wraps its DDP models on the new group. The names restored."""
    ranks = list(range(cluster.size))
    return _restore(cluster, ranks, carried.snap, carried.rewrap, carried.imports)[0]


def _leave_and_snapshot(cluster: Any, framework: str, ranks: list[int]) -> tuple[Any, Any]:
    """``ranks`` leave the group (DDP models unwrapped, variables kept), and the first of them
    gives its session: where its DDP models were, and its snapshot."""
    left = gather(
        ranks, [cluster.apply_async(r, healing.leave_group, framework) for r in ranks],
        HEAL_TIMEOUT_S, late=_late,
    )  # fmt: skip
    return left[0], cluster.apply_async(ranks[0], healing.snapshot).get(HEAL_TIMEOUT_S)


def _restore(
    cluster: Any, ranks: list[int], snap: Any, rewrap: Any, imports: tuple[str, ...]
) -> list[Any]:
    """Every rank of ``ranks`` takes the snapshot; what each restored."""
    return gather(
        ranks, [cluster.apply_async(r, healing.restore, snap, rewrap, imports) for r in ranks],
        HEAL_TIMEOUT_S, late=_late,
    )  # fmt: skip


def unhealable(cluster: Any, framework: str, dead: Sequence[int]) -> str | None:
    """Why what the survivors hold cannot rebuild the ranks ``dead`` (None: it can): sharded
    state (FSDP2, DTensors), of which each survivor holds only its own shards. (A healing that
    replaces every engine sends a survivor's whole models, built again in the next scope.)"""
    if backends.load(framework).FIXED_CLUSTER is not None:
        return None
    split = cluster.apply_async(_source(cluster.size, dead), healing.sharded).get(HEAL_TIMEOUT_S)
    if not split:
        return None
    lost = ", ".join(map(str, sorted(set(dead))))
    return (
        f"{', '.join(split)} {'is' if len(split) == 1 else 'are'} sharded across the ranks "
        f"(FSDP2, DTensor): the shards of rank {lost} died with it, and no survivor holds "
        "them. Save a checkpoint (torch.distributed.checkpoint) to resume sharded training"
    )


def _late(rank: int) -> Exception:
    return TimeoutError(f"rank {rank} did not answer")


def _heal_every_engine(
    cluster: Any, dead: list[int], source: int, imports: tuple[str, ...], fixed: tuple[str, str]
) -> Healed:
    """TensorFlow's best: a survivor's variables (Keras models saved whole) to new engines on
    every rank, the models built at the next cell in the new strategy's scope."""
    snap = cluster.apply_async(source, healing.keras_snapshot).get(HEAL_TIMEOUT_S)
    lost = ", ".join(map(str, dead))
    cluster.replace_engines(
        notice="",  # the healing's first line said so
        why=f"rank {lost} died, and a {fixed[1]} cannot change its cluster",
        note=None,
    )
    ranks = list(range(cluster.size))
    kept = gather(
        ranks,
        [cluster.apply_async(r, healing.keep_for_strategy, snap, imports) for r in ranks],
        HEAL_TIMEOUT_S,
        late=_late,
    )
    return Healed(
        ranks=tuple(dead), source=source, sent=tuple(snap.sent), unsent=dict(snap.unsent),
        rewrapped=(), size=cluster.size, rebuilt=tuple(kept[0]), everyone=fixed,
        modules=tuple(snap.modules),
    )  # fmt: skip


def try_heal(
    cluster: Any,
    framework: str | None,
    dead: Sequence[int],
    *,
    variables: bool,
    notify: Any,
    announce: Any = None,
    gone: str | None = None,
    interrupted: bool = False,
    imports: tuple[str, ...] = (),
) -> Healed | None:
    """Heal if it can be done (:func:`heal`), and say so; else say why not (unless there was
    nothing to keep) and return None: the caller replaces the engines, as before. ``gone``:
    how the ranks died, said first; ``announce``: where the first line goes, at once, before
    the seconds a healing takes (``notify`` by default); ``interrupted``: as for
    :func:`why_not`; ``imports``: as for :func:`heal`."""
    why = why_not(cluster, framework, dead, variables=variables, interrupted=interrupted)
    head = f"nbdist: {gone}; " if gone else "nbdist: "
    if why is not None or framework is None:  # (why_not said why when there is no framework)
        if variables:
            notify(f"{head}not healed: {why}.")
        return None
    try:
        why = unhealable(cluster, framework, dead)
    except Exception as e:  # noqa: BLE001 - a survivor that does not answer: the old way
        why = f"rank {_source(cluster.size, dead)} did not answer ({e})"
    if why is not None:
        notify(f"{head}not healed: {why}.")
        return None
    (announce or notify)(f"{head}{announcement(framework, dead, cluster.size)}")
    try:
        healed = heal(cluster, framework, dead, imports)
    except Exception as e:  # noqa: BLE001 - the old way then, with why
        notify(f"nbdist: healing failed ({type(e).__name__}: {e}).")
        return None
    notify(f"nbdist: {healed.text()}")
    return healed


def announcement(framework: str | None, dead: Sequence[int], size: int) -> str:
    """What a healing is about to do, said as it starts."""
    dead = sorted(set(dead))
    source = _source(size, dead)
    fixed = backends.load(framework).FIXED_CLUSTER if framework is not None else None
    if fixed is not None:
        return (
            f"healing the session: a {fixed} cannot change its cluster in "
            f"place, so every engine is being replaced and given rank {source}'s variables..."
        )
    many = len(dead) > 1
    return (
        f"healing the session: starting {'new engines' if many else 'a new engine'} for "
        f"rank{'s' if many else ''} {', '.join(map(str, dead))} and sending "
        f"{'them' if many else 'it'} rank {source}'s variables..."
    )


def _source(size: int, dead: Sequence[int]) -> int:
    """The rank a healing takes the session from: the lowest that survived."""
    return next(r for r in range(size) if r not in dead)
