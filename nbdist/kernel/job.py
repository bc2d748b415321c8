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
from typing import Any

from nbdist.engine import backends, worker
from nbdist.engine.spec import RankReport, RankSpec
from nbdist.engine.waiting import WHERE_KEY
from nbdist.errors import RankFailure
from nbdist.kernel.cluster import LocalCluster
from nbdist.kernel.display import LiveView
from nbdist.kernel.metrics import MetricsStream, Rounds
from nbdist.kernel.relay import OutputRelay
from nbdist.kernel.watch import IDLE_CPU_SHARE, Watch

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
    meta: dict[str, Any]
    released: set[int] = field(default_factory=set)  # session ranks that dropped their group
    dropped: set[str] = field(default_factory=set)  # variables those ranks dropped
    replaced: bool = False  # the engines were replaced (a rank was killed or died)
    hosts_pids: dict[int, tuple[str, int]] = field(default_factory=dict)  # dead/killed positions


class Job:
    """Runs ``specs`` (one per rank that takes part) and watches them until each is done."""

    def __init__(
        self,
        cluster: LocalCluster,
        specs: Sequence[RankSpec],
        *,
        opts: Any,
        live: LiveView,
        out: Any,
        err: Any,
        world: int,
        left_out: Sequence[RankSpec] = (),
    ) -> None:
        self.cluster = cluster
        self.left_out = list(left_out)  # the group's ranks an --on cell does not run on
        self.specs = list(specs)
        self.ranks = [s.rank for s in specs]
        self.opts = opts
        self.live = live
        self.world = world  # ranks in the group: --on runs a job on some of them
        self.framework = specs[0].framework
        noise = getattr(backends.load(self.framework), "OUTPUT_NOISE", None)
        self.outputs = OutputRelay.for_job(self.ranks, opts, out, err, noise=noise)
        self.stream = MetricsStream(len(specs))
        self.rounds = Rounds(len(specs), PUMP_EVERY_S)
        self.watch = Watch()
        self._release: dict[int, Any] = {}  # session rank -> its drop_session AsyncResult
        self._frees_peers = True  # the backend's RELEASE_FREES_PEERS, read in run()
        self._blocked_at = 0.0  # when the pending ranks' CPU was last sampled after a failure
        self._blocked_cpu: dict[int, float] | None = None
        self.ars: list[Any] = []
        self._release_s = 0.0

    def run(self) -> Outcome:
        start = time.monotonic()
        # An --on cell: the ranks it leaves out still take part in setting up the group (a
        # first init_process_group, or a new strategy, needs every rank).
        joining = [self.cluster.apply_async(s.rank, worker.join_group, s) for s in self.left_out]
        ars = [self.cluster.apply_async(s.rank, worker.run_rank, s) for s in self.specs]
        self.ars = ars
        backend = backends.load(self.framework)
        release = backend.peer_release_s(self.specs[0].options)
        self._release_s = release
        self._frees_peers = backend.RELEASE_FREES_PEERS
        # The first CPU sample a second in: a short cell never pays for reading /proc.
        self.watch.cpu_at = start
        self._watch(ars, start, release)
        wall = time.monotonic() - start
        watch = self.watch
        # ipyparallel may report a dead engine's task as failed before our liveness poll did.
        # A rank nbdist killed itself is "stopped", never "died".
        seen_dead = set(watch.dead) | set(self._dead(range(len(ars))))
        watch.dead = sorted(seen_dead - set(watch.killed))
        # A task's result can overtake its last printed lines (they come on another channel):
        # seen in a notebook, a 0.05 s cell whose prints never showed.
        deadline = time.monotonic() + LAST_OUTPUT_WAIT_S
        for p, ar in enumerate(ars):
            if ar.ready() and p not in watch.dead and p not in watch.killed:
                ar.wait_for_output(max(0.0, deadline - time.monotonic()))
        self.outputs.pump(ars, final=True)
        outcome = Outcome(
            ranks=self.ranks, world=self.world, ars=ars, watch=watch, wall=wall, reports={},
            failures=[], stopped=[], history=[], meta={},
        )  # fmt: skip
        lost = sorted(set(watch.killed) | set(watch.dead))
        if lost:
            outcome.hosts_pids = {
                p: (
                    self.cluster.engines[self.ranks[p]].host,
                    self.cluster.engines[self.ranks[p]].pid,
                )
                for p in lost
            }
            names = ", ".join(str(self.ranks[p]) for p in lost)
            why = f"{'rank' if len(lost) == 1 else 'ranks'} {names} had to be killed or died"
            self.cluster.replace_engines(why=why)
            outcome.replaced = True
        else:
            self._confirm_released(outcome)
        deadline = time.monotonic() + RELEASED_WAIT_S
        for ar in joining:  # quick: setting up a group the ranks that run the cell joined
            try:
                ar.get(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - the cell's own ranks report what went wrong
                log.debug("a left-out rank could not join the group", exc_info=True)
        collect(outcome, self.specs, self.cluster)
        reports = outcome.reports
        expected = [reports[p].messages if p in reports else 0 for p in range(len(ars))]
        drain(self.stream, ars, expected)
        if watch.reason in (None, "failure") and not watch.stalled:
            # A collective with a timeout (TensorFlow's) fails when its peer finished the cell
            # instead of waiting for it: failures.py tells that apart from a rank's own error.
            failed = [p for p, ar in enumerate(ars) if ar.ready() and _failed(ar)]
            if failed:
                watch.stalled = self._record(failed, {})
        outcome.history = self.stream.history
        outcome.meta = self.stream.meta[0]
        return outcome

    # -- watching --------------------------------------------------------------------------------
    def _watch(self, ars: list[Any], start: float, release: float) -> None:
        """Poll until every rank is done, escalating when something goes wrong.

        The notebook's interrupt is taken as a flag that the loop reads, not as the
        KeyboardInterrupt Python raises wherever the main thread happens to be: raised inside a
        weakref callback or a ``__del__`` it is printed as "Exception ignored" and lost (seen
        here: a Keras fit that the interrupt never reached).
        """
        with _sigint_as_flag() as interrupts:
            self._poll(ars, start, release, interrupts)

    def _poll(
        self, ars: list[Any], start: float, release: float, interrupts: threading.Event
    ) -> None:
        opts, watch, stream, live = self.opts, self.watch, self.stream, self.live
        peer_grace = release + PEER_GRACE_S
        kill_grace = release + KILL_GRACE_S
        next_liveness = time.monotonic() + LIVENESS_EVERY_S
        next_pump = 0.0
        while True:
            try:
                if interrupts.is_set():
                    interrupts.clear()
                    raise KeyboardInterrupt
                now = time.monotonic()
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
                    live.update(history, states(ars, watch), total_steps=total)
                now = time.monotonic()
                if watch.reason is None:
                    if any(ars[p].ready() and _failed(ars[p]) for p in range(len(ars))):
                        watch.start("failure", now)
                    elif opts.timeout is not None and now - start > opts.timeout:
                        watch.start("timeout", now - peer_grace)
                    elif watch.stuck(pending, now, opts.stall):
                        # Every rank idle for a good part of the limit is part of the stall: the
                        # one furthest behind is the culprit, the others wait for it. (Their last
                        # points arrive in any order within a flush interval.)
                        stuck = watch.stuck(pending, now, opts.stall / 2)
                        since = {p: watch.progress.get(p, watch.first_progress) for p in stuck}
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
                        watch.start("died", now)
                if watch.reason is not None:
                    waited = now - watch.since
                    # The group is broken now: the ranks that are done (or that --on left out)
                    # drop their part of it, which frees peers blocked in a collective. After a
                    # failure only once the others wait (no CPU use): ranks still computing may
                    # finish on their own, and the group may then be kept. Where that frees
                    # nobody (TensorFlow), they are left alone: the settling drops every
                    # session once no rank waits.
                    running = {self.ranks[p] for p in pending}
                    idle = [
                        r for r in range(self.world) if r not in running and r not in self._release
                    ]
                    if (
                        idle
                        and self._frees_peers
                        and (
                            watch.reason != "failure"
                            or waited >= peer_grace
                            or self._blocked(pending, now)
                        )
                    ):
                        self._release_ranks(idle)
                    if not watch.interrupted and waited >= peer_grace:
                        watch.interrupted = True
                        self.cluster.interrupt([self.ranks[p] for p in pending])
                    elif watch.interrupted and waited >= peer_grace + kill_grace:
                        alive = [p for p in pending if p not in watch.dead]
                        self.cluster.kill([self.ranks[p] for p in alive])
                        watch.killed.extend(alive)
                        return
                    if watch.dead and set(pending) <= set(watch.dead):
                        return
                ars[pending[0]].wait(POLL_S)  # returns as soon as that rank is done
            except KeyboardInterrupt:
                if watch.reason == "interrupt":  # a second interrupt: stop waiting, kill now
                    watch.since = time.monotonic() - peer_grace - kill_grace
                else:
                    watch.reason = "interrupt"
                    watch.since = time.monotonic() - peer_grace
                    watch.interrupted = False

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
        self.watch.start("stalled", now if len(pending) < self.world else now - peer_grace)

    def _record(
        self, waiting: list[int], idle_for: dict[int, float], *, all_idle: bool = False
    ) -> dict[str, Any]:
        """Who stalled (``idle_for``), at which step, where the ``waiting`` positions wait,
        and which ranks finished the cell meanwhile."""
        steps = {self.ranks[p]: s for p, s in enumerate(self.stream.last_step)}
        return {
            "ranks": [self.ranks[p] for p in idle_for],
            "steps": steps,
            "idle": {self.ranks[p]: seconds for p, seconds in idle_for.items()},
            "framework": self.framework,
            "release_s": self._release_s,  # how long a waiting rank takes to notice a lost peer
            # Where each waiting rank's cell is (nbdist.engine.waiting), when it said.
            "where": {self.ranks[p]: _where(self.ars[p]) for p in waiting},
            # Ranks that finished the cell while others wait: they ran fewer steps.
            "finished": [
                self.ranks[p]
                for p, ar in enumerate(self.ars)
                if p not in waiting and ar.ready() and not _failed(ar)
            ],
            **({"all_idle": True} if all_idle else {}),
        }

    def _blocked(self, pending: list[int], now: float) -> bool:
        """Whether the ranks still running look blocked (they used almost no CPU over the last
        ``BLOCKED_WINDOW_S``): after a peer failed, that is a collective waiting for it."""
        if now - self._blocked_at < BLOCKED_WINDOW_S:
            return False
        cpu = self.cluster.cpu_seconds([self.ranks[p] for p in pending])
        if cpu is None:  # a connected cluster: no process to look at
            return now - self.watch.since >= RELEASE_S
        previous, self._blocked_cpu = self._blocked_cpu, cpu
        dt, self._blocked_at = now - self._blocked_at, now
        if previous is None:
            return False
        return all(r in previous and cpu[r] - previous[r] < IDLE_CPU_SHARE * dt for r in cpu)

    def _release_ranks(self, ranks: Sequence[int]) -> None:
        dead = {self.ranks[p] for p in self.watch.dead}
        for r in ranks:
            if r in self._release or r in dead or r >= self.cluster.size:
                continue
            try:
                self._release[r] = self.cluster.apply_async(r, worker.drop_session, self.framework)
            except Exception:  # an engine the hub has dropped (it died): nothing to free
                log.debug("rank %d cannot be released", r, exc_info=True)

    def _confirm_released(self, outcome: Outcome) -> None:
        deadline = time.monotonic() + RELEASED_WAIT_S
        for r, ar in self._release.items():
            try:
                outcome.dropped.update(ar.get(max(0.0, deadline - time.monotonic())))
                outcome.released.add(r)
            except Exception:  # the engine could not drop its group: failures.py restarts
                pass

    def _dead(self, positions: Sequence[int]) -> list[int]:
        dead = set(self.cluster.dead([self.ranks[p] for p in positions]))
        return [p for p in positions if self.ranks[p] in dead]


def states(ars: list[Any], watch: Watch) -> list[str]:
    """Each rank's state for the panel."""
    out = []
    for ar in ars:
        if not ar.ready():
            out.append("stopping" if watch.reason else "running")
        elif _failed(ar):
            stopped = watch.interrupted and _failure_type(ar) == "KeyboardInterrupt"
            out.append("stopped" if stopped else "failed")
        else:
            out.append("done")
    return out


def _where(ar: Any) -> dict[str, Any] | None:
    try:
        return ar.data.get(WHERE_KEY)
    except Exception:  # the task's metadata could not be read: where it waits is unknown
        return None


def _failure_type(ar: Any) -> str | None:
    try:
        return ar.get(0).failure.exc_type
    except Exception:
        return None


def _failed(ar: Any) -> bool:
    try:
        return ar.get(0).failure is not None
    except Exception:
        return True


def drain(stream: MetricsStream, ars: list[Any], expected: list[int]) -> None:
    """Read the metrics messages still in flight when the results arrived."""
    deadline = time.monotonic() + LAST_METRICS_WAIT_S
    while True:
        for pos, ar in enumerate(ars):
            stream.pump(pos, ar.data)
        if stream.complete(expected) or time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


def collect(outcome: Outcome, specs: Sequence[RankSpec], cluster: LocalCluster) -> None:
    """Reports of the ranks that finished; failures; ranks that had to be stopped."""
    watch = outcome.watch
    for pos, (spec, ar) in enumerate(zip(specs, outcome.ars, strict=True)):
        if not ar.ready() or pos in watch.dead or pos in watch.killed:
            if pos not in watch.dead:
                outcome.stopped.append(spec.rank)
            continue
        try:
            report = ar.get(0)
        except Exception as e:  # the engine itself failed to run the task
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
        outcome.reports[pos] = report
        f = report.failure
        if f is not None:
            if f.exc_type == "KeyboardInterrupt" and watch.interrupted:
                outcome.stopped.append(spec.rank)
                continue
            outcome.failures.append(f)


@contextmanager
def _sigint_as_flag() -> Iterator[threading.Event]:
    """SIGINT sets the yielded event (main thread only; elsewhere the event never fires)."""
    interrupts = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupts.set())
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)
