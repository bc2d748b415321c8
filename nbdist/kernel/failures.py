"""What happens when a rank fails: the session's state afterwards, and the one error to show.

The workers keep their variables from cell to cell, so a failed cell must leave either a
session that still works, or a clean one, with the user told which:

* **kept** — the ranks that failed raised on their own (a typo, a shape error), the others
  finished, no rank had to be freed or stopped, and a check that cannot hang
  (:func:`nbdist.engine.worker.check_group`: a barrier with a ``HEALTH_TIMEOUT_S`` timeout)
  passes on every rank. As in a Python REPL, the variables stay.
* **dropped** — anything that may have broken the group: one rank raised while others waited
  in a collective, an interrupt, ``--timeout``, a stall, a failed check. Every rank drops its
  variables and its part of the group (the variables first: destroying a gloo group under a
  live DDP model can deadlock); the next cell makes a new rendezvous. The error ends with the
  names of the variables dropped.
* **replaced** — a rank was killed or died, or SIGINT interrupted a framework that cannot go
  on after it (TensorFlow: ``SURVIVES_INTERRUPT``): the engines were replaced, and their
  variables went with them.
"""

from __future__ import annotations

import time
from typing import Any

from nbdist.engine import backends, worker
from nbdist.errors import (
    DistrainError,
    JobInterrupted,
    JobStalled,
    JobTimeout,
    RanksDisagree,
    WorkerDied,
    WorkerError,
    lost_peer,
)
from nbdist.kernel.cluster import LocalCluster
from nbdist.kernel.job import Outcome

HEALTH_TIMEOUT_S = 2.0
HEALTH_WAIT_S = HEALTH_TIMEOUT_S + 3.0  # the check itself, plus the round trip
DROP_WAIT_S = 15.0


def settle(cluster: LocalCluster, outcome: Outcome, framework: str) -> tuple[str, list[str]]:
    """Bring the session to a known state after ``outcome``: ``("ok" | "kept" | "dropped" |
    "replaced", names of the variables dropped)``."""
    watch = outcome.watch
    if outcome.replaced:
        return "replaced", []
    interrupted = watch.interrupted or any(
        f.exc_type == "KeyboardInterrupt" for f in outcome.failures
    )
    if interrupted and not backends.load(framework).SURVIVES_INTERRUPT:
        why = "an interrupt stopped TensorFlow, which cannot go on after one"
        cluster.replace_engines(why=why)
        return "replaced", []
    if watch.reason is None and not outcome.failures:
        return "ok", []
    # The ranks that raised did so on their own and no rank had to be freed or stopped: the group
    # may still work; a barrier over the whole group (--on's left-out ranks too) says whether.
    own_errors = (
        watch.reason in (None, "failure")
        and not outcome.stopped
        and not outcome.released
        and not any(lost_peer(f) or f.exc_type == "KeyboardInterrupt" for f in outcome.failures)
    )
    if own_errors and _group_works(cluster, framework, list(range(outcome.world))):
        return "kept", []
    everyone = [r for r in range(cluster.size) if r not in outcome.released]
    return "dropped", drop(cluster, framework, everyone, already=outcome.dropped)


def _group_works(cluster: LocalCluster, framework: str, ranks: list[int]) -> bool:
    ars = [
        cluster.apply_async(r, worker.check_group, framework, timeout=HEALTH_TIMEOUT_S)
        for r in ranks
    ]
    deadline = time.monotonic() + HEALTH_WAIT_S
    verdicts = []
    for ar in ars:
        try:
            verdicts.append(ar.get(max(0.0, deadline - time.monotonic())))
        except Exception as e:  # timed out or failed: the group cannot be trusted
            verdicts.append(f"{type(e).__name__}: {e}")
    return all(v is None for v in verdicts)


def drop(
    cluster: LocalCluster, framework: str, ranks: list[int], *, already: set[str] | None = None
) -> list[str]:
    """Every rank in ``ranks`` drops its variables and its part of the group; returns the
    names dropped (with ``already``, those dropped earlier in the same job). A rank that does
    not confirm in time gets the engines replaced: the next cell must start clean."""
    # First, so that an interrupt during the waits below cannot leave the next cell on this
    # rendezvous: some ranks may have destroyed their part of it already.
    if not backends.load(framework).KEEPS_RENDEZVOUS_AFTER_FAILURE:
        cluster.rendezvous.pop(framework, None)
    names = set(already or ())
    ars = {r: cluster.apply_async(r, worker.drop_session, framework) for r in ranks}
    deadline = time.monotonic() + DROP_WAIT_S
    stuck = []
    for r, ar in ars.items():
        try:
            names.update(ar.get(max(0.0, deadline - time.monotonic())))
        except Exception:
            stuck.append(r)
    if stuck:
        why = f"rank {stuck[0]} could not leave its process group cleanly"
        cluster.replace_engines(why=why)
    return sorted(names)


def state_line(state: str, names: list[str], *, connected_stale: str | None = None) -> str:
    """The last line of a failed cell's error: what happened to the workers' variables."""
    if state == "kept":
        return (
            "The workers' variables are kept (as after an error in a Python REPL); fix the "
            "cell and run it again."
        )
    if state == "dropped":
        what = f" ({', '.join(names)})" if names else ""
        if connected_stale:
            return f"The workers' variables were dropped{what}. {connected_stale}"
        return (
            f"The process group was rebuilt and the workers' variables were dropped{what}: "
            "re-run the cells that build them."
        )
    if state == "stopped":  # clean-up that had to replace the engines was interrupted
        what = f" ({', '.join(names)})" if names else ""
        return (
            f"The workers were stopped, and their variables{what} went with them: the next "
            "%%distrain starts new workers; re-run the cells that build them."
        )
    if state == "replaced":
        what = f" ({', '.join(names)})" if names else ""
        return connected_stale or (
            f"The engines were replaced, and the workers' variables{what} went with them: "
            "re-run the cells that build them."
        )
    return ""


def error_for(outcome: Outcome, opts: Any) -> DistrainError | None:
    """The one error that says what went wrong, or None when the job succeeded."""
    watch = outcome.watch
    job_ranks = outcome.ranks
    stopped = sorted(outcome.stopped)
    named = ", ".join(map(str, stopped or job_ranks))
    if watch.dead:
        where = ", ".join(
            f"rank {job_ranks[p]} (host {outcome.hosts_pids[p][0]}, pid {outcome.hosts_pids[p][1]})"
            for p in watch.dead
        )
        if watch.reason == "interrupt":  # the process exited on the interrupt itself
            return JobInterrupted(
                f"interrupted (Stop button or Kernel > Interrupt); stopped ranks "
                f"{', '.join(map(str, job_ranks))}; {where} exited on the interrupt"
            )
        return WorkerDied(f"{where} died during the job")
    if watch.reason == "stalled":
        if opts.on is None and disagreement(watch.stalled):
            return RanksDisagree(disagree_message(watch.stalled, opts.stall, outcome))
        return JobStalled(stall_message(watch.stalled, opts.stall, stopped, job_ranks, on=opts.on))
    if (
        watch.reason in (None, "failure")  # None: the last rank to end was the one that failed
        and opts.on is None
        and watch.stalled.get("finished")
        and outcome.failures
        and all(lost_peer(f) for f in outcome.failures)
    ):  # the only errors are collectives that timed out waiting for ranks that had finished
        return RanksDisagree(disagree_message(watch.stalled, None, outcome))
    if outcome.failures:  # a KeyboardInterrupt here came from the cell itself, not from nbdist
        return WorkerError(outcome.failures, stopped=stopped)
    if watch.reason == "timeout":
        return JobTimeout(
            f"the job ran past --timeout {opts.timeout:g} s; stopped ranks {named}. "
            "Raise --timeout or make the cell shorter."
        )
    if watch.reason == "interrupt":
        return JobInterrupted(
            f"interrupted (Stop button or Kernel > Interrupt); stopped ranks {named}."
        )
    return None


def _waits_in(where: dict[str, Any] | None) -> str:
    """`` in <collective> (cell line N: <text>)`` as far as the rank told where it waits."""
    if not where:
        return ""
    what = f" in {where['collective']}" if where.get("collective") else ""
    return f"{what} (cell line {where['line']}: {where['line_text']})"


def _collectives(stalled: dict[str, Any]) -> dict[int, str]:
    return {
        r: w["collective"]
        for r, w in stalled.get("where", {}).items()
        if w and w.get("collective") and r in stalled["ranks"]
    }


def disagreement(stalled: dict[str, Any]) -> bool:
    """Whether a stall is ranks that disagree: some finished the cell while others wait, or
    the waiting ranks sit in different collectives."""
    return bool(stalled.get("finished")) or len(set(_collectives(stalled).values())) > 1


_SAME_STEPS = {
    "torch": "give every rank the same number of batches (DistributedSampler pads; "
    "drop_last=True), or wrap the loop in torch.distributed.algorithms.Join",
    "tf": "give every worker the same number of steps (the same steps_per_epoch, a dataset "
    "each worker reads the same number of batches from)",
}


def disagree_message(stalled: dict[str, Any], limit: float | None, outcome: Outcome) -> str:
    """Which ranks finished (after how many steps) or where each waits, and the fix; ``limit``
    is the ``--stall`` that caught it, None when the waiting ranks' collectives timed out."""
    steps, where = stalled["steps"], stalled.get("where", {})
    waiting = [r for r in outcome.ranks if r not in stalled.get("finished", [])]

    def at(rank: int) -> str:
        step = "before its first step" if steps.get(rank) is None else f"at step {steps[rank]}"
        return f"rank {rank} waits {step}{_waits_in(where.get(rank))}"

    freed = [r for r in waiting if r not in outcome.stopped]
    if outcome.replaced:
        tail = (
            f"Rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} could not be "
            "freed and had to be killed."
        )
    elif freed and stalled.get("framework") == "tf" and outcome.watch.interrupted:
        tail = (
            f"nbdist interrupted rank{'s' if len(freed) > 1 else ''} "
            f"{', '.join(map(str, freed))}; TensorFlow cannot go on after an interrupt, so the "
            "engines were replaced."
        )
    elif freed and stalled.get("framework") == "tf":
        # TensorFlow's collectives notice a peer that left only at their timeout.
        tail = (
            f"TensorFlow's collective timeout ({stalled.get('release_s', 0):g} s) freed "
            f"rank{'s' if len(freed) > 1 else ''} {', '.join(map(str, freed))}: the engines are "
            "the same."
        )
    elif freed:
        tail = (
            f"nbdist freed rank{'s' if len(freed) > 1 else ''} {', '.join(map(str, freed))} "
            f"without killing {'them' if len(freed) > 1 else 'it'}: the engines are the same."
        )
    else:
        tail = f"Stopped ranks {', '.join(map(str, outcome.stopped))}."
    if stalled.get("finished"):
        done = ", ".join(
            f"rank {r} finished the cell"
            + ("" if steps.get(r) is None else f" after {steps[r] + 1} steps")
            for r in stalled["finished"]
        )
        fix = _SAME_STEPS.get(stalled.get("framework"), _SAME_STEPS["torch"])
        gone = stalled["finished"]
        lead = "" if limit is None else f"no progress for {limit:g} s: "
        return (
            f"{lead}{done}, while {'; '.join(map(at, waiting))}: a "
            f"collective that rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} "
            f"will never join. The ranks ran different numbers of steps: {fix}. {tail}"
        )
    return (
        f"no progress for {limit:g} s: the ranks wait in different collectives: "
        f"{'; '.join(map(at, waiting))}. Every rank must call the same collectives in the same "
        "order: look for a collective under `if rank == ...`, or in a loop whose length differs "
        f"between ranks. {tail}"
    )


def stall_message(
    stalled: dict[str, Any],
    limit: float,
    stopped: list[int],
    job_ranks: list[int],
    *,
    on: tuple[int, ...] | None = None,
) -> str:
    """Names the stalled ranks that are furthest behind as stuck; the others as waiting."""
    steps = stalled["steps"]
    who = ", ".join(map(str, stopped or job_ranks))
    if on is not None:
        waiting = ", ".join(map(str, stalled["ranks"]))
        return (
            f"no progress for {limit:g} s: rank{'s' if len(stalled['ranks']) > 1 else ''} "
            f"{waiting} wait{'' if len(stalled['ranks']) > 1 else 's'} in a collective that "
            f"needs every rank, but --on ran only ranks {', '.join(map(str, on))}. Run "
            "collectives (DDP training, all_reduce, barrier) without --on; use --on for "
            "inspecting or plotting on some ranks."
        )
    if stalled.get("all_idle"):
        ranks = ", ".join(map(str, stalled["ranks"]))
        return (
            f"no progress for {limit:g} s and every rank sits idle (ranks {ranks}, no CPU use, "
            "none past its first step): they are waiting on each other, e.g. a collective that "
            "not every rank reached, mismatched collectives, or a rank blocked on a sleep, a lock "
            f"or input. Stopped ranks {who}. If the cell "
            "waits on purpose (a download), allow longer with --stall S."
        )

    def at(rank: int) -> str:
        return "before its first step" if steps.get(rank) is None else f"at step {steps[rank]}"

    def key(rank: int) -> int:
        return -1 if steps.get(rank) is None else steps[rank]

    behind = min(key(r) for r in stalled["ranks"])
    stuck = [r for r in stalled["ranks"] if key(r) == behind]
    where = stalled.get("where", {})
    # At the same step, a rank in a collective waits for one that is not.
    waiting = [r for r in stuck if (where.get(r) or {}).get("collective")]
    if waiting and len(waiting) < len(stuck):
        stuck = [r for r in stuck if r not in waiting]
    parts = [
        f"rank {r} is stuck {at(r)}{_waits_in(where.get(r))} (no progress for "
        f"{stalled['idle'][r]:.0f} s)"
        for r in stuck
    ]
    parts += [
        f"rank {r} waits {at(r)}{_waits_in(where.get(r))}" for r in job_ranks if r not in stuck
    ]
    return (
        f"no progress for {limit:g} s: {'; '.join(parts)}. "
        f"Stopped ranks {', '.join(map(str, stopped or job_ranks))}. Look for what the stuck "
        "rank waits for (a collective the other ranks skipped, a sleep, a deadlock), or allow "
        "longer pauses with --stall S."
    )
