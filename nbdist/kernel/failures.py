"""The words of a failed cell: the one error to show, and the line that ends it.

:mod:`nbdist.kernel.cell` decides what a failed cell leaves of the session (kept, dropped,
replaced); this module says it: which error (``WorkerError``, ``WorkerDied``, ``JobStalled``,
``RanksDisagree``, ...) and its message from the job's outcome and stall record, the last line
naming the variables lost (``state_line``), a note when the workers' private network explains
the failure, and what to do about ranks a connected cluster left running.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from nbdist.engine import backends
from nbdist.errors import (
    DistrainError,
    JobInterrupted,
    JobStalled,
    JobTimeout,
    RankFailure,
    RanksDisagree,
    WorkerDied,
    WorkerError,
    lost_peer,
)
from nbdist.kernel.cluster import Cluster
from nbdist.kernel.job import Outcome
from nbdist.kernel.netns import resolver_reachable
from nbdist.protocol import Reason, Stall, Waiting
from nbdist.ranks import spans


def state_line(
    state: str,
    names: list[str],
    *,
    connected_stale: str | None = None,
    replicas: Any = None,
    sharded: Sequence[str] = (),
    framework: str | None = None,
    raised: Sequence[int] = (),
    why: str = "",
) -> str:
    """The last line of a failed cell's error: what happened to the workers' variables
    (``names``: those kept for "kept" and "rebuilt", those lost otherwise). ``replicas``:
    after a rebuilt group, whether the models agree (``cell.Replicas``); ``sharded``: the
    variables that made a rebuild drop them; ``raised``: the ranks whose own error it was;
    ``why``: why variables were dropped where nothing else says (", since ...")."""
    if state == "kept":
        if not names:
            return "The workers hold no variables; fix the cell and run it again."
        return (
            f"The workers' variables are kept ({', '.join(names)}), as after an error in a "
            "Python REPL; fix the cell and run it again."
        )
    if state == "rebuilt":
        return rebuilt_line(names, replicas, framework, raised)
    if state == "dropped":
        what = f" ({', '.join(names)})" if names else ""
        if connected_stale:
            return f"The workers' variables were dropped{what}. {connected_stale}"
        if sharded:
            one = len(sharded) == 1
            return (
                f"The process group was rebuilt; {', '.join(sharded)} {'is' if one else 'are'} "
                "sharded across the ranks (FSDP2, DTensor), and shards cannot move to a new "
                f"group, so the workers' variables were dropped{what}: re-run the cells that "
                "build them (or save a checkpoint with torch.distributed.checkpoint to resume)."
            )
        return (
            f"The process group was rebuilt and the workers' variables were dropped{what}{why}: "
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


def rebuilt_line(
    names: Sequence[str], replicas: Any, framework: str | None, raised: Sequence[int] = ()
) -> str:
    """After a rebuilt group: that every rank kept its variables, what the next cell wraps
    again, and whether the replicas still agree, with the command that makes them agree (from
    rank 0, or from the first rank that did not raise)."""
    kept = f" ({', '.join(names)})" if names else ""
    backend = backends.load(framework or backends.frameworks()[0])
    line = f"The {backend.GROUP} was rebuilt and every rank kept its variables{kept}"
    if replicas is None or not replicas.models:
        return line + "."
    models = list(replicas.models)
    line += "; the next cell " + backend.REWRAP.format(models=", ".join(models))
    if not replicas.differ:
        one = len(models) == 1
        return line + f". {', '.join(models)} {'is' if one else 'are'} the same on every rank."
    differ = "; ".join(
        f"{label} on rank{_s(ranks)} {spans(ranks)}" for label, ranks in replicas.differ.items()
    )
    names_to_sync = sorted({_top(label) for label in models} | set(replicas.optimizers))
    source = 0
    if 0 in raised:
        source = min((r for ranks in replicas.differ.values() for r in ranks if r not in raised),
                     default=0)  # fmt: skip
    flag = f" --from {source}" if source else ""
    return (
        f"{line}. The replicas differ from rank 0's ({differ}): a rank that raised or was "
        f"stopped mid-step can be a step behind. %distrain sync {','.join(names_to_sync)}{flag} "
        f"gives every rank rank {source}'s; %distrain compare {_top(models[0])} shows the "
        "difference."
    )


def _top(label: str) -> str:
    """The variable a label is in: ``trainer`` for ``trainer.model``, ``models`` for
    ``models[0]``."""
    return re.split(r"[.\[]", label, maxsplit=1)[0]


def still_running(engines: Sequence[Any]) -> str:
    """What to do about ranks of a connected cluster that ignored the interrupt and the
    collective timeout: nbdist does not kill engines it did not start."""
    where = ", ".join(f"rank {e.rank} (host {e.host}, pid {e.pid})" for e in engines)
    return (
        f"{where} still {'runs' if len(engines) == 1 else 'run'} the cell: nbdist does not kill "
        f"engines it did not start, and {'its' if len(engines) == 1 else 'their'} next cell "
        "waits for this one. Stop "
        f"{'it' if len(engines) == 1 else 'them'} on the host (kill -INT PID, kill PID), or "
        "restart the engines with the launcher that started them."
    )


def error_for(outcome: Outcome, opts: Any, cluster: Cluster) -> DistrainError | None:
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
        hosts = sorted({outcome.hosts_pids[p][0] for p in watch.dead})
        lost = cluster.describe_lost(where, len(watch.dead), hosts)
        if lost is not None and watch.reason != Reason.INTERRUPT:
            return WorkerDied(lost)
        how = "; ".join(
            f"rank {job_ranks[p]} {outcome.exits[p]}" for p in watch.dead if outcome.exits.get(p)
        )
        if watch.reason == Reason.INTERRUPT:  # the process exited on the interrupt itself
            return JobInterrupted(
                f"interrupted (Stop button or Kernel > Interrupt); stopped ranks "
                f"{', '.join(map(str, job_ranks))}; {where} exited on the interrupt"
            )
        return WorkerDied(f"{where} died during the job" + (f": {how}" if how else ""))
    if watch.reason == Reason.STALLED and watch.stalled is not None:
        stall: JobStalled
        if opts.on is None and disagreement(watch.stalled):
            stall = RanksDisagree(disagree_message(watch.stalled, opts.stall, outcome))
        else:
            stall = JobStalled(
                stall_message(watch.stalled, opts.stall, stopped, job_ranks, on=opts.on)
            )
        stall.flight = flight_line(watch.stalled)
        return stall
    if (
        watch.reason in (None, Reason.FAILURE)  # None: the last rank to end was the one that failed
        and opts.on is None
        and watch.stalled is not None
        and watch.stalled.finished
        and outcome.failures
        and all(lost_peer(f) for f in outcome.failures)
    ):  # the only errors are collectives that timed out waiting for ranks that had finished
        disagree = RanksDisagree(disagree_message(watch.stalled, None, outcome))
        disagree.flight = flight_line(watch.stalled)
        return disagree
    if outcome.failures:  # a KeyboardInterrupt here came from the cell itself, not from nbdist
        return WorkerError(outcome.failures, stopped=stopped)
    if watch.reason == Reason.TIMEOUT:
        return JobTimeout(
            f"the job ran past --timeout {opts.timeout:g} s"
            + (f"; stopped ranks {named}" if stopped or not watch.abandoned else "")
            + ". Raise --timeout or make the cell shorter."
        )
    if watch.reason == Reason.INTERRUPT:
        text = f"interrupted (Stop button or Kernel > Interrupt); stopped ranks {named}."
        if outcome.no_boundary:
            text += (
                f" Asked to stop at a step boundary, rank{_s(outcome.no_boundary)} "
                f"{spans(outcome.no_boundary)} reached none within {outcome.stop_wait:g} s (a loop "
                "with no optimizer.step() or log() call, a rank blocked in a data loader or a "
                "collective), so the ranks were interrupted."
            )
        if watch.killed:
            killed = sorted(job_ranks[p] for p in watch.killed)
            text += (
                f" Rank{_s(killed)} {spans(killed)} did not stop on the interrupt and "
                f"{'was' if len(killed) == 1 else 'were'} killed."
            )
        return JobInterrupted(text)
    return None


def graceful_stop(
    stopped_at: dict[int, int],
    step_text: Callable[[int], str] = lambda s: f"step {s}",
    *,
    why: str | None = None,
) -> JobInterrupted:
    """The cell a graceful stop ended: after which step (``stopped_at``: each rank's steps
    taken; said as the panel numbers steps, from 0 as ``for step in range(n)`` does, and by
    ``step_text``: the cell's, and the session's where they differ), and that the session goes
    on. ``why``: who asked, when not the notebook (a Slurm job's time-limit warning)."""
    steps = sorted(set(stopped_at.values()))
    if len(steps) == 1:
        taken = steps[0]
        where = (
            f"every rank stopped after {step_text(taken - 1)} ({taken} step"
            f"{'' if taken == 1 else 's'} taken)"
            if taken
            else "every rank stopped before its first step"
        )
    else:  # no collective in each step kept the ranks together
        where = (
            "the ranks stopped after different numbers of steps of this cell ("
            + ", ".join(f"rank {r}: {s}" for r, s in sorted(stopped_at.items()))
            + "): the loop has no collective in every step to keep them together"
        )
    error = JobInterrupted(f"stopped ({why or 'Stop button or Kernel > Interrupt'}): {where}.")
    error.outside = why is not None
    error.state = (
        "The workers' variables are kept and the process group stays: the next cell continues "
        "from there (%distrain compare model checks the replicas)."
    )
    return error


def _s(items: Sequence[Any]) -> str:
    return "s" if len(items) > 1 else ""


# A rank's error that says the network is not there: a name that does not resolve, no route.
_NO_NETWORK = re.compile(
    r"gaierror|name resolution|Name or service not known|nodename nor servname|"
    r"Network is unreachable|No route to host",
    re.IGNORECASE,
)


def network_note(failures: list[RankFailure], network: Any) -> str | None:
    """A line for a failure that the workers' private network explains (a download in a
    cell), or None: what the workers can reach, and what to do."""
    if network is None or not network.private:
        return None
    said = [f"{f.exc_type}: {f.message}\n{f.traceback}" for f in failures if not f.collateral]
    if not any(_NO_NETWORK.search(text) for text in said):
        return None
    if network.outbound is None:
        reach = "a network of their own with no way out"
    elif not resolver_reachable():
        reach = (
            "a network of their own whose outbound link cannot reach this machine's resolver "
            "(it listens on the machine's own loopback: /etc/resolv.conf)"
        )
    else:
        reach = "a network of their own with outbound connections only (slirp4netns)"
    return (
        f"The workers run in {reach}: download in a notebook cell (the workers see the "
        "notebook's files), or restart them on this machine's network: %distrain restart "
        "--network host."
    )


def _waits_in(where: Waiting | None, cell: str) -> str:
    """`` in <collective> (Cell In[12], line N: <text>)`` as far as the rank told where it
    waits (``cell``: the cell's label)."""
    if where is None:
        return ""
    what = f" in {where.collective}" if where.collective else ""
    return f"{what} ({cell}, line {where.line}: {where.line_text})"


def flight_line(stalled: Stall) -> str:
    """What torch's flight recorder saw: each stalled rank's last collective, numbered, and
    how far behind the others a rank is ("" where no rank's recorder said)."""
    seen = {r: w.flight for r, w in sorted(stalled.where.items()) if w is not None and w.flight}
    if not seen:
        return ""
    line = "torch's flight recorder, each rank's last collective: " + ", ".join(
        f"rank {r} {f}" for r, f in seen.items()
    )
    numbers = {r: int(m.group(1)) for r, f in seen.items() if (m := re.match(r"#(\d+) ", f))}
    if len(numbers) > 1 and len(set(numbers.values())) > 1:
        top = max(numbers.values())
        behind = [
            f"rank {r} is {top - n} collective{'s' if top - n > 1 else ''} behind"
            for r, n in numbers.items()
            if n < top
        ]
        line += f" ({'; '.join(behind)})"
    return line + "."


def _collectives(stalled: Stall) -> dict[int, str]:
    return {
        r: w.collective
        for r, w in stalled.where.items()
        if w is not None and w.collective and r in stalled.ranks
    }


def disagreement(stalled: Stall) -> bool:
    """Whether a stall is ranks that disagree: some finished the cell while others wait, or
    the waiting ranks sit in different collectives."""
    return bool(stalled.finished) or len(set(_collectives(stalled).values())) > 1


def disagree_message(stalled: Stall, limit: float | None, outcome: Outcome) -> str:
    """Which ranks finished (after how many steps) or where each waits, and the fix; ``limit``
    is the ``--stall`` that caught it, None when the waiting ranks' collectives timed out."""
    steps, where = stalled.steps, stalled.where
    waiting = [r for r in outcome.ranks if r not in stalled.finished]

    def at(rank: int) -> str:
        step = "before its first step" if steps.get(rank) is None else f"at step {steps[rank]}"
        return f"rank {rank} waits {step}{_waits_in(where.get(rank), stalled.cell)}"

    freed = [r for r in waiting if r not in outcome.stopped]
    backend = backends.load(stalled.framework)
    if outcome.replaced:
        tail = (
            f"Rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} could not be "
            "freed and had to be killed."
        )
    elif freed and not backend.SURVIVES_INTERRUPT and outcome.watch.interrupted:
        tail = (
            f"nbdist interrupted rank{'s' if len(freed) > 1 else ''} "
            f"{', '.join(map(str, freed))}; {backend.TITLE} cannot go on after an interrupt, so "
            "the engines were replaced."
        )
    elif freed and not backend.RELEASE_FREES_PEERS:
        # Its collectives notice a peer that left only at their timeout.
        tail = (
            f"{backend.TITLE}'s collective timeout ({stalled.release_s:g} s) freed "
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
    if stalled.finished:
        done = ", ".join(
            f"rank {r} finished the cell"
            + ("" if (n := steps.get(r)) is None else f" after {n + 1} steps")
            for r in stalled.finished
        )
        fix = backend.SAME_STEPS
        gone = stalled.finished
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
    stalled: Stall,
    limit: float,
    stopped: list[int],
    job_ranks: list[int],
    *,
    on: tuple[int, ...] | None = None,
) -> str:
    """Names the stalled ranks that are furthest behind as stuck; the others as waiting."""
    steps = stalled.steps
    who = ", ".join(map(str, stopped or job_ranks))
    if on is not None:
        waiting = ", ".join(map(str, stalled.ranks))
        return (
            f"no progress for {limit:g} s: rank{'s' if len(stalled.ranks) > 1 else ''} "
            f"{waiting} wait{'' if len(stalled.ranks) > 1 else 's'} in a collective that "
            f"needs every rank, but --on ran only ranks {', '.join(map(str, on))}. Run "
            "collectives (DDP training, all_reduce, barrier) without --on; use --on for "
            "inspecting or plotting on some ranks."
        )
    if stalled.all_idle:
        ranks = ", ".join(map(str, stalled.ranks))
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
        step = steps.get(rank)
        return -1 if step is None else step

    behind = min(key(r) for r in stalled.ranks)
    stuck = [r for r in stalled.ranks if key(r) == behind]
    where = stalled.where
    # At the same step, a rank in a collective waits for one that is not.
    in_collective = [r for r in stuck if (w := where.get(r)) is not None and w.collective]
    if in_collective and len(in_collective) < len(stuck):
        stuck = [r for r in stuck if r not in in_collective]
    parts = [
        f"rank {r} is stuck {at(r)}{_waits_in(where.get(r), stalled.cell)} (no progress for "
        f"{stalled.idle[r]:.0f} s)"
        for r in stuck
    ]
    parts += [
        f"rank {r} waits {at(r)}{_waits_in(where.get(r), stalled.cell)}"
        for r in job_ranks
        if r not in stuck
    ]
    return (
        f"no progress for {limit:g} s: {'; '.join(parts)}. "
        f"Stopped ranks {', '.join(map(str, stopped or job_ranks))}. Look for what the stuck "
        "rank waits for (a collective the other ranks skipped, a sleep, a deadlock), or allow "
        "longer pauses with --stall S."
    )
