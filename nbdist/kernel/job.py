"""One ``%%distrain`` cell on the workers: submit, relay output, watch, collect.

Stopping a job that went wrong escalates, each step bounded (times from ``shared/NOTES.md`` and
this project's fault tests). The backend's ``peer_release_s`` is how long a rank blocked in a
collective takes to notice a lost peer: about 1 s for torch (a rank that drops its part of the
group frees its peers), the collective timeout for TensorFlow.

1. A rank that raises reports its failure. Once the ranks still running look blocked (no CPU
   use over ``BLOCKED_WINDOW_S``), the ranks that are done drop their part of the group, and
   peers blocked in a collective with them fail within ``peer_release_s``; ranks that are still
   computing may finish on their own (then the group may be kept). On a stall, ``--timeout`` or
   an interrupt, ranks that are done (or that ``--on`` left out) drop their part at once: the
   waiting ranks are freed without being killed. A backend whose ranks cannot free their peers
   that way (``RELEASE_FREES_PEERS`` false: TensorFlow, whose collective timeout frees them)
   leaves the ranks that are done alone until no rank waits.
2. Ranks still running ``peer_release_s + PEER_GRACE_S`` later (at once on ``--timeout`` or the
   notebook's interrupt) get SIGINT: a rank in Python code (a sleep, a loop) stops at once.
3. Ranks still running ``peer_release_s + KILL_GRACE_S`` after that are killed and every engine
   is replaced, so the next run starts clean.

What the outcome means for the session (kept variables or a rebuilt group) is decided in
:mod:`nbdist.kernel.failures`, and so is the error: the stall record kept here (each rank's last
step, where each waiting rank's cell is as :mod:`nbdist.engine.waiting` reported it, which ranks
finished meanwhile) tells ranks that disagree (``RanksDisagree``) from one stuck rank.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from nbdist.engine import backends, worker
from nbdist.errors import RankFailure
from nbdist.kernel.breakpoints import Desk
from nbdist.kernel.cluster import Cluster
from nbdist.kernel.display import LiveView
from nbdist.kernel.engines import Status, replies, reply
from nbdist.kernel.metrics import MetricsStream, Rounds
from nbdist.kernel.phases import Phases
from nbdist.kernel.relay import OutputRelay
from nbdist.kernel.watch import IDLE_CPU_SHARE, Watch
from nbdist.protocol import (
    STOPPING_KEY,
    WHERE_KEY,
    RankReport,
    RankSpec,
    RankState,
    Reason,
    RunMeta,
    Stall,
    Waiting,
)

log = logging.getLogger(__name__)

# Beyond the time the backend says a blocked peer needs to notice a lost rank:
PEER_GRACE_S = 2.0  # ... before SIGINT to the ranks still running
KILL_GRACE_S = 3.0  # ... after that, before SIGKILL
# After a rank failed, the ranks still running are sampled every BLOCKED_WINDOW_S: when none
# of them uses the CPU, they wait in a collective for the failed one, and are freed. Where the
# processes cannot be seen (a connected cluster), after RELEASE_S.
BLOCKED_WINDOW_S = 0.2
RELEASE_S = 0.3
POLL_S = 0.005  # a trivial warm cell takes ~15 ms on the engines: poll finer than that
PUMP_EVERY_S = 0.05
LIVENESS_EVERY_S = 0.25
CPU_SAMPLE_EVERY_S = 1.0
LAST_METRICS_WAIT_S = 2.0  # results can overtake the last metrics message (another channel)
LAST_OUTPUT_WAIT_S = 2.0  # ... and the last lines a rank printed
RELEASED_WAIT_S = 10.0  # for the ranks told to drop their part of the group to confirm
EXIT_WAIT_S = 5.0  # for the process of an engine ipyparallel called dead to be seen gone
# A graceful stop (nbdist.engine.stopping) that has not ended every rank this long after the
# interrupt falls back to the interrupt: a rank reached no step boundary meanwhile. Ranks whose
# steps are slower get three of their steps (the agreement takes two), up to the maximum.
GRACEFUL_WAIT_S = 3.0
GRACEFUL_WAIT_MAX_S = 30.0


@dataclass
class Outcome:
    """What a job left: the reports of the ranks that finished and how the others ended."""

    ranks: list[int]  # session ranks, one per position
    world: int  # ranks in the group (more than ``ranks`` for an --on cell)
    ars: list[Any]
    watch: Watch
    wall: float
    reports: dict[int, RankReport]  # by position
    failures: list[RankFailure]
    stopped: list[int]  # positions that had to be stopped
    history: list[dict[str, Any]]
    meta: RunMeta
    released: set[int] = field(default_factory=set)  # session ranks that dropped their session
    left: set[int] = field(default_factory=set)  # ... that left the group, their variables kept
    dropped: set[str] = field(default_factory=set)  # variables those ranks dropped
    sharded: set[str] = field(default_factory=set)  # ... because these were sharded
    lost: list[int] = field(default_factory=list)  # positions that died or were killed
    replaced: bool = False  # the engines were replaced (a rank was killed or died)
    shrunk: bool = False  # a connected cluster went on without the engines it lost
    healed: Any = None  # nbdist.kernel.healing.Healed: the lost ranks rebuilt from a survivor
    hosts_pids: dict[int, tuple[str, int]] = field(default_factory=dict)  # dead/killed positions
    exits: dict[int, str] = field(default_factory=dict)  # how each dead position's engine ended
    stop_asked: bool = False  # a graceful stop was asked for
    no_boundary: list[int] = field(default_factory=list)  # session ranks it did not stop in time
    stop_wait: float = GRACEFUL_WAIT_S  # how long the graceful stop was given


class Clock(Protocol):
    """What a job reads the time from and waits with: the real one, or a test's."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float, /) -> None: ...


class _RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float, /) -> None:
        time.sleep(seconds)


REAL_CLOCK: Clock = _RealClock()


class Job:
    """Runs ``specs`` (one per rank that takes part) and watches them until each is done."""

    def __init__(
        self,
        cluster: Cluster,
        specs: Sequence[RankSpec],
        *,
        opts: Any,
        live: LiveView,
        out: Any,
        err: Any,
        world: int,
        left_out: Sequence[RankSpec] = (),
        display: Any = None,
        breakpoints: Desk | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.clock = clock or REAL_CLOCK  # every wait and deadline of the job reads it
        self.cluster = cluster
        self.breakpoints = breakpoints  # ranks at breakpoint(), prompted for in the notebook
        self._out = out
        self.left_out = list(left_out)  # the group's ranks an --on cell does not run on
        self.specs = list(specs)
        self.ranks = [s.rank for s in specs]
        self.opts = opts
        self.live = live
        self.world = world  # ranks in the group: --on runs a job on some of them
        self.framework = specs[0].framework
        noise = getattr(backends.load(self.framework), "OUTPUT_NOISE", None)
        self.outputs = OutputRelay.for_job(self.ranks, opts, out, err, noise=noise, display=display)
        self.stream = MetricsStream(len(specs))
        self.rounds = Rounds(len(specs), PUMP_EVERY_S)
        self.watch = Watch()
        self._joining: list[Any] = []
        self._release: dict[int, Any] = {}  # session rank -> its worker.release AsyncResult
        self._frees_peers = True  # the backend's RELEASE_FREES_PEERS, read in run()
        self._blocked_at: float | None = None  # when the pending ranks' CPU was last sampled
        self._blocked_cpu: dict[int, float] | None = None
        self.ars: list[Any] = []
        self._release_s = 0.0
        self._collective_s = 0.0
        self._graceful = False  # the backend can stop its ranks at a step boundary
        self._survives_interrupt = True  # the backend's SURVIVES_INTERRUPT, read in run()
        self._stop_asked: float | None = None  # when a graceful stop was asked for
        self._no_boundary: list[int] = []
        self._stop_step: int | None = None  # the step the ranks agreed to stop after
        self._stop_wait = GRACEFUL_WAIT_S  # how long the graceful stop may take

    def watch_until_done(self, phases: Phases | None = None) -> Outcome:
        """Submit every rank's task and watch them until each is done (or stopped); the
        ranks that died or had to be killed are in the outcome's ``lost``. ``phases``: where
        the time goes (memory, submit, watch, settle)."""
        phases = phases or Phases()
        start = self.clock.monotonic()
        self.cluster.note_memory()
        phases.mark("memory")
        # An --on cell: the ranks it leaves out still take part in setting up the group (a
        # first init_process_group, or a new strategy, needs every rank).
        self._joining = [
            self.cluster.apply_async(s.rank, worker.join_group, s) for s in self.left_out
        ]
        ars = [self.cluster.apply_async(s.rank, worker.run_rank, s) for s in self.specs]
        self.ars = ars
        phases.mark("submit")
        backend = backends.load(self.framework)
        release = backend.peer_release_s(self.specs[0].options)
        self._release_s = release
        self._collective_s = backend.collective_timeout(self.specs[0].options)
        self._frees_peers = backend.RELEASE_FREES_PEERS
        self._graceful = backend.GRACEFUL_STOP
        self._survives_interrupt = backend.SURVIVES_INTERRUPT
        # The first CPU sample a second in: a short cell never pays for reading /proc.
        self.watch.cpu_at = start
        try:
            self._watch(ars, start, release)
        finally:
            if self.breakpoints is not None:
                self.breakpoints.end_cell()
        phases.mark("watch")
        wall = self.clock.monotonic() - start
        watch = self.watch
        # ipyparallel may report a dead engine's task as failed before our liveness poll did.
        # A rank nbdist killed itself is "stopped", never "died".
        seen_dead = set(watch.dead) | set(self._dead(range(len(ars))))
        # ipyparallel fails the task of an engine whose nanny saw it go (its pipe closed) while
        # the process still exits: an engine the out-of-memory killer took frees its memory
        # before it is a zombie, and meanwhile it looked alive (a CI run: the cell then ended
        # as an ordinary error, and the health check found the engine gone).
        unreported = {p for p, ar in enumerate(ars) if ar.ready() and _engine_died(ar)}
        deadline = self.clock.monotonic() + EXIT_WAIT_S
        while unreported - seen_dead - set(watch.killed) and self.clock.monotonic() < deadline:
            self.clock.sleep(0.05)
            seen_dead |= set(self._dead(sorted(unreported - seen_dead)))
        watch.dead = sorted(seen_dead - set(watch.killed))
        # A task's result can overtake its last printed lines (they come on another channel):
        # seen in a notebook, a 0.05 s cell whose prints never showed.
        deadline = self.clock.monotonic() + LAST_OUTPUT_WAIT_S
        for p, ar in enumerate(ars):
            if ar.ready() and p not in watch.dead and p not in watch.killed:
                ar.wait_for_output(max(0.0, deadline - self.clock.monotonic()))
        self.outputs.pump(ars, final=True)
        outcome = Outcome(
            ranks=self.ranks, world=self.world, ars=ars, watch=watch, wall=wall, reports={},
            failures=[], stopped=[], history=[], meta=RunMeta(),
        )  # fmt: skip
        outcome.lost = sorted(set(watch.killed) | set(watch.dead))
        outcome.stop_asked = self._stop_asked is not None
        outcome.no_boundary = self._no_boundary
        outcome.stop_wait = self._stop_wait
        for p in outcome.lost:
            engine = self.cluster.engines[self.ranks[p]]
            outcome.hosts_pids[p] = (engine.host, engine.pid)
            outcome.exits[p] = self.cluster.how_ended(self.ranks[p])
        return outcome

    def finish(self, outcome: Outcome) -> None:
        """After the watch (and the engines lost replaced, if any): which ranks let go of the
        group, every rank's report, the last metrics."""
        watch, ars = outcome.watch, outcome.ars
        if not outcome.lost:
            self._confirm_released(outcome)
        # Quick: setting up a group the ranks that run the cell joined. What went wrong, the
        # cell's own ranks report.
        joined = replies(range(len(self._joining)), self._joining, RELEASED_WAIT_S)
        for r in joined:
            if not r.ok:
                log.debug("a left-out rank could not join the group: %s", r.error)
        collect(outcome, self.specs, self.cluster)
        reports = outcome.reports
        expected = [reports[p].messages if p in reports else 0 for p in range(len(ars))]
        drain(self.stream, ars, expected, self.clock)
        if watch.reason in (None, Reason.FAILURE) and watch.stalled is None:
            # A collective with a timeout (TensorFlow's) fails when its peer finished the cell
            # instead of waiting for it: failures.py tells that apart from a rank's own error.
            failed = [p for p, ar in enumerate(ars) if ar.ready() and _failed(ar)]
            if failed:
                watch.stalled = self._record(failed, {})
        outcome.history = self.stream.history
        outcome.meta = self.stream.meta[0]

    # -- watching --------------------------------------------------------------------------------
    def _watch(self, ars: list[Any], start: float, release: float) -> None:
        """Poll until every rank is done, escalating when something goes wrong.

        The notebook's interrupt is taken as a flag that the loop reads, not as the
        KeyboardInterrupt Python raises wherever the main thread happens to be: raised inside a
        weakref callback or a ``__del__`` it is printed as "Exception ignored" and lost (seen
        here: a Keras fit that the interrupt never reached).
        """
        with _sigint_counted() as interrupts:
            self._poll(ars, start, release, interrupts)

    def _poll(self, ars: list[Any], start: float, release: float, interrupts: Interrupts) -> None:
        opts, watch, stream, live = self.opts, self.watch, self.stream, self.live
        peer_grace = release + PEER_GRACE_S
        kill_grace = release + KILL_GRACE_S
        next_liveness = self.clock.monotonic() + LIVENESS_EVERY_S
        next_pump = 0.0
        tick = self.clock.monotonic()
        while True:
            try:
                if interrupts.take():  # one at a time: a second one is the next round's
                    raise KeyboardInterrupt
                desk = self.breakpoints
                if desk is not None:
                    was = desk.active
                    desk.serve(lambda text: print(text, file=self._out, flush=True), self._stop)
                    if was or desk.active:
                        # A rank in the debugger makes no progress, and its peers wait for it:
                        # the time at the prompt counts for neither --stall nor --timeout.
                        paused = self.clock.monotonic() - tick
                        start += paused
                        watch.shift(paused)
                        if self._stop_asked is not None:
                            self._stop_asked += paused
                tick = self.clock.monotonic()
                now = self.clock.monotonic()
                pending = [p for p, ar in enumerate(ars) if not ar.ready()]
                if not pending:
                    return
                if now >= next_pump:
                    # Reading a task's output or data parses its metadata (~0.1 ms each): not
                    # at every poll. Lines are held for OutputRelay.HOLD_S anyway.
                    next_pump = now + PUMP_EVERY_S
                    due = self.rounds.next()
                    self.outputs.pump(ars, positions=due)
                    for pos in due:
                        if stream.pump(pos, ars[pos].data):
                            watch.note_progress(pos, now)
                    history, total = stream.history, stream.total_steps()
                    key = stream.meta[0].model
                    live.update(
                        history, states(ars, watch), total_steps=total, key=key,
                        where=where_shown(ars, watch, start, now, self.ranks),
                    )  # fmt: skip
                    if self._stop_asked is not None and self._stop_step is None:
                        self._stop_step = _agreed_step(ars)
                        if self._stop_step is not None:
                            live.stopping(self._stop_step)
                now = self.clock.monotonic()
                if (
                    watch.reason is None
                    and self._stop_asked is not None
                    and now - self._stop_asked >= self._stop_wait
                ):
                    # No step boundary reached by every rank in time: the interrupt, as before.
                    self._no_boundary = [self.ranks[p] for p in pending]
                    watch.reason = Reason.INTERRUPT
                    watch.since = now - peer_grace
                    watch.interrupted = False
                if watch.reason is None:
                    if any(ars[p].ready() and _failed(ars[p]) for p in range(len(ars))):
                        watch.start(Reason.FAILURE, now)
                    elif opts.timeout is not None and now - start > opts.timeout:
                        watch.start(Reason.TIMEOUT, now - peer_grace)
                    elif watch.stuck(pending, now, opts.stall):
                        # Every rank idle for a good part of the limit is part of the stall: the
                        # one furthest behind is the culprit, the others wait for it. (Their last
                        # points arrive in any order within a flush interval.)
                        stuck = watch.stuck(pending, now, opts.stall / 2)
                        first = watch.first_progress  # (set: a rank is stuck)
                        first = now if first is None else first
                        since = {p: watch.progress.get(p, first) for p in stuck}
                        self._stall(
                            pending, now, peer_grace, {p: now - t for p, t in since.items()}
                        )
                if (
                    watch.reason is None
                    and watch.first_progress is None
                    and now - watch.cpu_at >= CPU_SAMPLE_EVERY_S
                ):
                    cpu = self.cluster.cpu_seconds([self.ranks[p] for p in pending])
                    if cpu is not None:
                        cpu = {self.ranks.index(r): t for r, t in cpu.items()}
                    watch.sample_cpu(cpu, now)
                    if watch.all_idle(pending, now, opts.stall):
                        idle = {p: now - watch.busy_at[p] for p in pending}
                        self._stall(pending, now, peer_grace, idle, all_idle=True)
                if now >= next_liveness:
                    next_liveness = now + LIVENESS_EVERY_S
                    dead = [p for p in self._dead(pending) if p not in watch.dead]
                    if dead:
                        watch.dead.extend(dead)
                        watch.start(Reason.DIED, now)
                if watch.reason is not None:
                    waited = now - watch.since
                    # The group is broken now: the ranks that are done (or that --on left out)
                    # drop their part of it, which frees peers blocked in a collective. After a
                    # failure only once the others wait (no CPU use): ranks still computing may
                    # finish on their own, and the group may then be kept. Where that frees
                    # nobody (TensorFlow), they are left alone: the settling drops every
                    # session once no rank waits.
                    running = {self.ranks[p] for p in pending}
                    done = [
                        r for r in range(self.world) if r not in running and r not in self._release
                    ]
                    if (
                        done
                        and self._frees_peers
                        and (
                            watch.reason != Reason.FAILURE
                            or waited >= peer_grace
                            or self._blocked(pending, now)
                        )
                    ):
                        self._release_ranks(done)
                    if not watch.interrupted and waited >= peer_grace:
                        watch.interrupted = True
                        self.cluster.interrupt([self.ranks[p] for p in pending])
                    elif watch.interrupted and waited >= peer_grace + self._kill_grace(kill_grace):
                        alive = [p for p in pending if p not in watch.dead]
                        if self.cluster.kill([self.ranks[p] for p in alive]):
                            watch.killed.extend(alive)
                            return
                        # Engines that are not nbdist's to kill (a connected cluster's): a rank
                        # blocked in a collective with one the controller lost is freed by the
                        # collective timeout; past that, nbdist stops waiting for it.
                        if waited >= peer_grace + kill_grace + self._collective_s:
                            watch.abandoned.extend(alive)
                            return
                    if watch.dead and set(pending) <= set(watch.dead):
                        return
                ars[pending[0]].wait(POLL_S)  # returns as soon as that rank is done
            except KeyboardInterrupt:
                self._stop(peer_grace, kill_grace)

    def _stop(self, peer_grace: float | None = None, kill_grace: float | None = None) -> None:
        """The notebook's interrupt (the Stop button, ``q`` at a breakpoint's prompt): a
        graceful stop where the ranks can reach a step boundary, else the interrupt."""
        watch = self.watch
        peer_grace = self._release_s + PEER_GRACE_S if peer_grace is None else peer_grace
        kill_grace = self._release_s + KILL_GRACE_S if kill_grace is None else kill_grace
        if watch.reason == Reason.INTERRUPT:  # a second interrupt: stop waiting, kill now
            watch.since = self.clock.monotonic() - peer_grace - kill_grace
        elif self._stop_asked is None and self._may_stop_gracefully():
            self._stop_asked = self.clock.monotonic()
            self._stop_wait = graceful_wait(self.stream.history, len(self.ars))
            self.cluster.ask_to_stop(self.ranks)
            self.live.stopping()
        else:  # the first interrupt, or a second one while a graceful stop waits
            watch.reason = Reason.INTERRUPT
            watch.since = self.clock.monotonic() - peer_grace
            watch.interrupted = False

    def _kill_grace(self, kill_grace: float) -> float:
        """How long ranks still running after SIGINT get before SIGKILL: ``kill_grace`` (which
        waits for the backend's collective to free a blocked peer), or ``KILL_GRACE_S`` after
        an interrupt where the engines are replaced anyway (TensorFlow cannot go on after one):
        waiting for TensorFlow's collective timeout then only ended the cell 15 s later with
        that rank's DeadlineExceededError instead of the interrupt."""
        if self.watch.reason == Reason.INTERRUPT and not self._survives_interrupt:
            return KILL_GRACE_S
        return kill_grace

    def _may_stop_gracefully(self) -> bool:
        """Whether the interrupt can be a graceful stop: the backend has a board, nothing went
        wrong yet, no rank is done, and the cell has stepped (a rank has sent metrics: it has a
        step boundary to reach). Not every rank need have: a peer's first points can be a
        flush behind (a CI run, under load, interrupted TensorFlow's fit for that), and in a job
        that steps in lockstep it is inside the cell too. A rank that is not yet (its stop
        request is then ignored) reaches no boundary, and the graceful wait's fallback
        interrupts it."""
        watch = self.watch
        return (
            self._graceful
            and watch.reason is None
            and not any(ar.ready() for ar in self.ars)
            and any(p in watch.progress for p in range(len(self.ars)))
        )

    def _stall(
        self,
        pending: list[int],
        now: float,
        peer_grace: float,
        idle_for: dict[int, float],
        *,
        all_idle: bool = False,
    ) -> None:
        """Stop a stalled job: ``idle_for`` holds the stalled positions and how long each has
        been idle. Ranks that are not waiting (finished, or left out by ``--on``) drop their
        part of the group first (the stop branch of the watch loop does it), which fails the
        pending collectives; SIGINT follows only after the backend's release time."""
        self.watch.stalled = self._record(pending, idle_for, all_idle=all_idle)
        # With ranks to free (not all of the group is waiting), SIGINT waits for their release.
        self.watch.start(Reason.STALLED, now if len(pending) < self.world else now - peer_grace)

    def _record(
        self, waiting: list[int], idle_for: dict[int, float], *, all_idle: bool = False
    ) -> Stall:
        """Who stalled (``idle_for``), at which step, where the ``waiting`` positions wait,
        and which ranks finished the cell meanwhile."""
        return Stall(
            ranks=[self.ranks[p] for p in idle_for],
            steps={self.ranks[p]: s for p, s in enumerate(self.stream.last_step)},
            idle={self.ranks[p]: seconds for p, seconds in idle_for.items()},
            framework=self.framework,
            release_s=self._release_s,
            cell=self.specs[0].cell.label,
            # Where each waiting rank's cell is (nbdist.engine.waiting), when it said.
            where={self.ranks[p]: _where(self.ars[p]) for p in waiting},
            # Ranks that finished the cell while others wait: they ran fewer steps.
            finished=[
                self.ranks[p]
                for p, ar in enumerate(self.ars)
                if p not in waiting and ar.ready() and not _failed(ar)
            ],
            all_idle=all_idle,
        )

    def _blocked(self, pending: list[int], now: float) -> bool:
        """Whether the ranks still running look blocked (they used almost no CPU over the last
        ``BLOCKED_WINDOW_S``): after a peer failed, that is a collective waiting for it."""
        if self._blocked_at is not None and now - self._blocked_at < BLOCKED_WINDOW_S:
            return False
        cpu = self.cluster.cpu_seconds([self.ranks[p] for p in pending])
        if cpu is None:  # a connected cluster: no process to look at
            return now - self.watch.since >= RELEASE_S
        previous, self._blocked_cpu = self._blocked_cpu, cpu
        since, self._blocked_at = self._blocked_at, now
        if previous is None or since is None:
            return False
        dt = now - since
        return all(r in previous and cpu[r] - previous[r] < IDLE_CPU_SHARE * dt for r in cpu)

    def _release_ranks(self, ranks: Sequence[int]) -> None:
        dead = {self.ranks[p] for p in self.watch.dead}
        for r in ranks:
            if r in self._release or r in dead or r >= self.cluster.size:
                continue
            # The rank keeps its variables: the settling rebuilds the group around them
            # (Cell.settle), and if a rank is lost (dies, or is killed for not stopping on the
            # interrupt), they are what heals it.
            try:
                self._release[r] = self.cluster.apply_async(r, worker.release, self.framework)
            except Exception:  # an engine the hub has dropped (it died): nothing to free
                log.debug("rank %d cannot be released", r, exc_info=True)

    def _confirm_released(self, outcome: Outcome) -> None:
        still = {self.ranks[p] for p in outcome.watch.abandoned}
        # (a rank in ``still``: its drop runs when its cell ends, settle() leaves it queued)
        asked = [r for r in self._release if r not in still]
        for answer in replies(asked, [self._release[r] for r in asked], RELEASED_WAIT_S):
            if not answer.ok:  # it did not leave its group (yet): the settling asks it again
                continue
            r, (kept, dropped, sharded) = answer.rank, answer.value
            if kept:
                outcome.left.add(r)
                continue
            outcome.dropped.update(dropped)  # sharded state: dropped, the group with it
            outcome.sharded.update(sharded)
            outcome.released.add(r)

    def _dead(self, positions: Sequence[int]) -> list[int]:
        dead = set(self.cluster.dead([self.ranks[p] for p in positions]))
        return [p for p in positions if self.ranks[p] in dead]


def states(ars: list[Any], watch: Watch) -> list[RankState]:
    """Each rank's state for the panel."""
    out = []
    for ar in ars:
        if not ar.ready():
            out.append(RankState.STOPPING if watch.reason else RankState.RUNNING)
        elif _failed(ar):
            failure = _failure(ar)
            stopped = watch.interrupted and failure is not None and failure.interrupted
            out.append(RankState.STOPPED if stopped else RankState.FAILED)
        else:
            out.append(RankState.DONE)
    return out


def graceful_wait(history: Sequence[dict[str, Any]], positions: int, last: int = 5) -> float:
    """How long a graceful stop may take: ``GRACEFUL_WAIT_S``, or three steps of the slowest
    rank when its steps are longer (the mean of its ``last`` intervals between points), at most
    ``GRACEFUL_WAIT_MAX_S``; rounded to a tenth of a second."""
    times: list[list[float]] = [[] for _ in range(positions)]
    for point in reversed(history):
        kept = times[point["rank"]]
        if len(kept) <= last:
            kept.append(point["time"])
        if all(len(t) > last for t in times):
            break
    steps = [(t[0] - t[-1]) / (len(t) - 1) for t in times if len(t) >= 2]
    slowest = max(steps, default=0.0)
    return round(min(GRACEFUL_WAIT_MAX_S, max(GRACEFUL_WAIT_S, 3 * slowest)), 1)


def _agreed_step(ars: list[Any]) -> int | None:
    """The step a graceful stop ends after, once a rank has said it agreed on one."""
    for ar in ars:
        try:
            step = ar.data.get(STOPPING_KEY)
        except Exception:  # the task's metadata could not be read
            continue
        if step is not None:
            return step
    return None


WHERE_SHOWN_AFTER_S = 3.0  # a running rank that has not stepped this long: the panel says where


def where_shown(
    ars: Sequence[Any], watch: Watch, start: float, now: float, ranks: Sequence[int]
) -> dict[int, Waiting]:
    """Where each running rank is, for the panel, once it has not stepped for
    ``WHERE_SHOWN_AFTER_S`` (a hang read as it forms, before ``--stall`` names it)."""
    shown = {}
    for pos, ar in enumerate(ars):
        since = watch.progress.get(pos, start)
        if now - since >= WHERE_SHOWN_AFTER_S and not ar.ready():
            where = _where(ar)
            if where is not None:
                shown[ranks[pos]] = where
    return shown


def _where(ar: Any) -> Waiting | None:
    try:
        return ar.data.get(WHERE_KEY)
    except Exception:  # the task's metadata could not be read: where it waits is unknown
        return None


def _failure(ar: Any) -> RankFailure | None:
    now = reply(0, ar, 0)
    return now.value.failure if now.ok else None


def _engine_died(ar: Any) -> bool:
    """Whether ipyparallel failed a finished task itself because its engine died (its nanny
    told the controller)."""
    return reply(0, ar, 0).status is Status.DIED


def _failed(ar: Any) -> bool:
    now = reply(0, ar, 0)
    return not now.ok or now.value.failure is not None


def drain(stream: MetricsStream, ars: list[Any], expected: list[int], clock: Clock) -> None:
    """Read the metrics messages still in flight when the results arrived."""
    deadline = clock.monotonic() + LAST_METRICS_WAIT_S
    while True:
        for pos, ar in enumerate(ars):
            stream.pump(pos, ar.data)
        if stream.complete(expected) or clock.monotonic() > deadline:
            return
        clock.sleep(POLL_S)


def collect(outcome: Outcome, specs: Sequence[RankSpec], cluster: Cluster) -> None:
    """Reports of the ranks that finished; failures; ranks that had to be stopped."""
    watch = outcome.watch
    for pos, (spec, ar) in enumerate(zip(specs, outcome.ars, strict=True)):
        if not ar.ready() or pos in watch.dead or pos in watch.killed:
            if pos not in watch.dead and pos not in watch.abandoned:
                outcome.stopped.append(spec.rank)
            continue
        now = reply(spec.rank, ar, 0)
        if now.error is not None:  # the engine itself failed to run the task
            e = now.error
            host = cluster.engines[spec.rank].host if spec.rank < cluster.size else "?"
            outcome.failures.append(
                RankFailure(
                    rank=spec.rank,
                    host=host,
                    exc_type=type(e).__name__,
                    message=str(e),
                    traceback=str(e),
                    time=time.time(),
                )
            )
            continue
        report = outcome.reports[pos] = now.value
        f = report.failure
        if f is not None:
            if f.interrupted and watch.interrupted:
                outcome.stopped.append(spec.rank)
                continue
            outcome.failures.append(f)


class Interrupts:
    """The interrupts that arrived and the watch loop has not taken yet, counted: two that
    arrive before the loop looks (its main thread busy a moment, e.g. importing) are two, the
    second of which stops every rank at once. A flag kept them as one (seen here: a double
    interrupt taken for a single one, and the graceful stop went on)."""

    def __init__(self) -> None:
        self.waiting = 0

    def arrived(self, signum: int = signal.SIGINT, frame: object = None) -> None:
        self.waiting += 1  # handlers run in the main thread, as the loop does: no lock needed

    def take(self) -> bool:
        """Whether one is waiting; it is taken."""
        if not self.waiting:
            return False
        self.waiting -= 1
        return True


@contextmanager
def _sigint_counted() -> Iterator[Interrupts]:
    """SIGINT counts in the yielded :class:`Interrupts` (main thread only; elsewhere none
    arrive there)."""
    interrupts = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return
    previous = signal.signal(signal.SIGINT, interrupts.arrived)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)
