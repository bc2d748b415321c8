"""What a failed cell does to the workers' group and variables: the checks and steps that
:meth:`nbdist.kernel.cell.Cell.settle` chooses between.

* **kept**: the group still works (:func:`group_works`: a barrier with a ``HEALTH_TIMEOUT_S``
  timeout on every rank): nothing to do, as after an error in a Python REPL.
* **rebuilt**: anything that may have broken the group; every rank leaves it with its variables
  kept, DDP models unwrapped, to be wrapped again by the next cell on a new group
  (:func:`rebuild`, ``worker.release``), and the replicas are compared (:func:`replicas`).
* **dropped**: what cannot be rebuilt (sharded state: FSDP2, DTensors), or a lost engine with
  healing off: every rank drops its variables, then its part of the group (:func:`drop`).

A rank that does not answer within ``DROP_WAIT_S`` gets the engines replaced: the next cell
must start clean.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from nbdist.engine import backends, healing, worker
from nbdist.errors import ClusterError
from nbdist.kernel.cluster import Cluster
from nbdist.kernel.engines import replies
from nbdist.protocol import SessionState

HEALTH_TIMEOUT_S = 2.0
HEALTH_WAIT_S = HEALTH_TIMEOUT_S + 3.0  # the check itself, plus the round trip
DROP_WAIT_S = 15.0


def group_works(cluster: Cluster, framework: str, ranks: list[int]) -> bool:
    """Whether the group still works on every rank of ``ranks`` (``worker.check_group``)."""
    try:
        ars = [
            cluster.apply_async(r, worker.check_group, framework, timeout=HEALTH_TIMEOUT_S)
            for r in ranks
        ]
    except ClusterError:  # an engine the controller no longer has: no group to keep
        return False
    # Timed out or failed: the group cannot be trusted.
    return all(r.ok and r.value is None for r in replies(ranks, ars, HEALTH_WAIT_S))


@dataclass
class Rebuilt:
    """What :func:`rebuild` left: the state, the names dropped, whether the replicas agree, and
    the sharded variables that made it drop them."""

    state: SessionState
    dropped: list[str] = field(default_factory=list)
    replicas: Replicas | None = None
    sharded: list[str] = field(default_factory=list)


def rebuild(
    cluster: Cluster,
    rendezvous: dict[str, Any],
    framework: str,
    ranks: list[int],
    *,
    queued: AbstractSet[int] = frozenset(),
) -> Rebuilt:
    """Every rank in ``ranks`` leaves the group with its variables kept (DDP models unwrapped,
    wrapped again by the next cell on a new group: ``worker.release``). Sharded state (FSDP2)
    cannot be kept: a rank that holds some drops its variables, and then every rank does. A
    rank that does not confirm in time gets the engines replaced. Ranks in ``queued`` still
    run the cell (see :func:`drop`)."""
    if not backends.load(framework).KEEPS_RENDEZVOUS_AFTER_FAILURE:
        rendezvous.pop(framework, None)
    answers, stuck = ask(cluster, ranks, worker.release, framework, queued=queued)
    if stuck:
        cluster.replace_engines(why=f"rank {stuck[0]} could not leave its process group cleanly")
        return Rebuilt(SessionState.REPLACED)
    if any(not kept for kept, _, _ in answers.values()):
        dropped = {n for kept, names, _ in answers.values() if not kept for n in names}
        sharded = sorted({n for _, _, split in answers.values() for n in split})
        kept_ranks = [r for r, (kept, _, _) in answers.items() if kept]
        names = drop(cluster, rendezvous, framework, kept_ranks, already=dropped, queued=queued)
        return Rebuilt(SessionState.DROPPED, dropped=names, sharded=sharded)
    compared = replicas(cluster, [r for r in range(cluster.size) if r not in queued], framework)
    return Rebuilt(SessionState.REBUILT, replicas=compared)


def drop(
    cluster: Cluster,
    rendezvous: dict[str, Any],
    framework: str,
    ranks: list[int],
    *,
    already: set[str] | None = None,
    queued: AbstractSet[int] = frozenset(),
) -> list[str]:
    """Every rank in ``ranks`` drops its variables and its part of the group; returns the
    names dropped (with ``already``, those dropped earlier in the same job). A rank that does
    not confirm in time gets the engines replaced: the next cell must start clean. Ranks in
    ``queued`` still run the cell (a connected engine nbdist may not kill): their drop waits
    behind it, and the next cell behind that."""
    # First, so that an interrupt during the waits below cannot leave the next cell on this
    # rendezvous: some ranks may have destroyed their part of it already.
    if not backends.load(framework).KEEPS_RENDEZVOUS_AFTER_FAILURE:
        rendezvous.pop(framework, None)
    answers, stuck = ask(cluster, ranks, worker.drop_session, framework, queued=queued)
    names = set(already or ()).union(*answers.values())
    if stuck:
        why = f"rank {stuck[0]} could not leave its process group cleanly"
        cluster.replace_engines(why=why)
    return sorted(names)


def ask(
    cluster: Cluster, ranks: list[int], fn: Any, *args: Any, queued: AbstractSet[int] = frozenset()
) -> tuple[dict[int, Any], list[int]]:
    """``fn(*args)`` on every rank in ``ranks``, each answer awaited up to ``DROP_WAIT_S`` in
    all: the answers by rank, and the ranks that gave none (in ``queued``: not awaited)."""
    ars = {r: cluster.apply_async(r, fn, *args) for r in ranks}
    awaited = [r for r in ranks if r not in queued]
    got = replies(awaited, [ars[r] for r in awaited], DROP_WAIT_S)
    return {r.rank: r.value for r in got if r.ok}, [r.rank for r in got if not r.ok]


@dataclass(frozen=True)
class Replicas:
    """After a rebuilt group: the models the next cell wraps in DDP again, which of them differ
    between ranks (label -> the ranks whose copy is not rank 0's), and the optimizers."""

    models: tuple[str, ...] = ()
    differ: dict[str, list[int]] = field(default_factory=dict)
    optimizers: tuple[str, ...] = ()


def replicas(cluster: Cluster, ranks: list[int], framework: str) -> Replicas | None:
    """What each rank holds after a rebuilt group (``healing.pending``), compared; None when a
    rank does not say."""
    answers, stuck = ask(cluster, ranks, healing.pending, framework)
    if stuck or 0 not in answers:
        return None
    digests, optimizers = answers[0]
    differ = {
        label: [r for r in sorted(answers) if answers[r][0].get(label) != digest]
        for label, digest in digests.items()
    }
    return Replicas(
        models=tuple(sorted(digests)),
        differ={label: ranks for label, ranks in differ.items() if ranks},
        optimizers=tuple(optimizers),
    )
