"""How a job that went wrong is stopped (``nbdist.kernel.job``): free, interrupt, kill, or give
up on a rank that is not nbdist's to kill; against in-memory ranks and a cluster that records
what it was asked, the way httpx tests its client against an in-memory transport, on a virtual
clock the job is given (no test sleeps: a wait moves the clock on to what is due). Times are
scaled down (tenths of a second where the real ones are seconds); the order, the outcome and
when each step happened are what is checked."""

from __future__ import annotations

import heapq
import itertools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from ipyparallel.error import RemoteError

from nbdist.engine import worker
from nbdist.engine.backends import torch_ddp
from nbdist.kernel import job as job_module
from nbdist.kernel.engines import EngineInfo
from nbdist.kernel.job import Job
from nbdist.kernel.options import parse_run_options
from nbdist.protocol import INTERRUPT, RankFailure, RankReport, RankSpec, RankState, Reason


@dataclass
class Rank:
    """How a fake rank behaves: it ends by itself after ``ends_after`` seconds (never: None),
    failing with ``fails`` (an exception type name); or it waits in a collective (freed, with a
    lost peer, when a peer lets go of the group); on SIGINT it stops, unless it ignores it."""

    ends_after: float | None = None
    fails: str | None = None
    in_collective: bool = False
    ignores_interrupt: bool = False
    dies_after: float | None = None
    # ipyparallel fails its task (its nanny saw it go) this long before its process is gone:
    # (when, how much later); an engine the out-of-memory killer took still frees its memory.
    unregistered_before_gone: tuple[float, float] | None = None
    release_fails: bool = False  # its worker.release raises (its group half left)


class Clock:
    """Virtual time for the job (``Job(clock=...)``) and the fake ranks: a sleep or a wait moves
    it on at once, running what was due meanwhile, in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.run_until(self.now + max(0.0, seconds))

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._due, (when, next(self._order), fn))

    def run_until(self, when: float, done: Callable[[], bool] = lambda: False) -> None:
        """Move on to ``when``, or to the first moment ``done()`` holds."""
        while self._due and self._due[0][0] <= when and not done():
            at, _, fn = heapq.heappop(self._due)
            self.now = max(self.now, at)
            fn()
        if not done():
            self.now = max(self.now, when)


class Task:
    """Stands where ipyparallel's AsyncResult does."""

    def __init__(self, rank: int, clock: Clock) -> None:
        self.clock = clock
        self.rank = rank
        self.report: RankReport | None = None
        self.error: Exception | None = None
        self.done_at: float | None = None
        self.stdout = self.stderr = ""
        self.data: dict = {}

    def end(self, failure: str | None = None, message: str = "", at: float | None = None):
        if self.done_at is not None:
            return
        f = None
        if failure is not None:
            f = RankFailure(rank=self.rank, host="h", exc_type=failure, message=message,
                            traceback="", time=time.time())  # fmt: skip
        self.report = RankReport(rank=self.rank, host="h", pid=100 + self.rank, failure=f)
        self.done_at = self.clock.now if at is None else at
        self.clock.at(self.done_at, lambda: None)  # a wait ends there

    def die(self) -> None:
        # What ipyparallel's client raises for the task of an engine that unregistered.
        self.error = RemoteError("EngineError", f"Engine {self.rank} died while running task", "")
        self.done_at = self.clock.now

    def ready(self) -> bool:
        return self.done_at is not None and self.clock.now >= self.done_at

    def get(self, timeout: float | None = None):
        self.wait(timeout or 0.0)
        if not self.ready():
            raise TimeoutError("Result not ready.")
        if self.error is not None:
            raise self.error
        return self.report

    def wait(self, timeout: float) -> None:
        self.clock.run_until(self.clock.now + timeout, done=self.ready)

    def wait_for_output(self, timeout: float) -> None:
        pass


class Cluster:
    """Records what the job asks of it; ``kills``: whether its engines are nbdist's to kill."""

    def __init__(self, ranks: list[Rank], *, kills: bool = True) -> None:
        self.clock = Clock()
        self.behaviour = ranks
        self.kills = kills
        self.tasks: dict[int, Task] = {}
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.killed: set[int] = set()
        self.engines = [
            EngineInfo(
                rank=r,
                engine_id=r,
                host="h",
                address="127.0.0.1",
                pid=100 + r,
                gpu=None,
                visible="",
                cuda_index=None,
                cpus=1,
                local_rank=r,
                local_world_size=len(ranks),
            )  # fmt: skip
            for r in range(len(ranks))
        ]

    @property
    def size(self) -> int:
        return len(self.engines)

    def apply_async(self, rank, fn, *args, **kwargs):
        task = Task(rank, self.clock)
        now = self.clock.now
        if fn is worker.run_rank:
            self.tasks[rank] = task
            how = self.behaviour[rank]
            if how.ends_after is not None:
                task.end(how.fails, at=now + how.ends_after)
            if how.dies_after is not None:
                self.clock.at(now + how.dies_after, lambda: self._die(rank))
            if how.unregistered_before_gone is not None:
                when, later = how.unregistered_before_gone
                self.clock.at(now + when, task.die)
                self.clock.at(now + when + later, lambda: self._die(rank))
        elif fn is worker.release:
            self.calls.append(("release", (rank,)))
            for r, other in self.tasks.items():  # a peer leaving frees those in a collective
                if r != rank and self.behaviour[r].in_collective:
                    other.end("RuntimeError", "Connection closed by peer")
            task.end()
            task.report = (True, [], [])  # it left the group, its variables kept
            if self.behaviour[rank].release_fails:
                task.error = RemoteError("RuntimeError", "could not destroy the group", "")
        else:
            task.end()
        return task

    def _die(self, rank: int) -> None:
        self.killed.add(rank)  # its process is gone; ipyparallel has not said so yet

    def interrupt(self, ranks):
        self.calls.append(("interrupt", tuple(ranks)))
        for r in ranks:
            if not self.behaviour[r].ignores_interrupt:
                self.tasks[r].end(INTERRUPT)

    def kill(self, ranks) -> bool:
        self.calls.append(("kill", tuple(ranks)))
        if not self.kills:
            return False
        for r in ranks:
            self.killed.add(r)
            self.tasks[r].die()
        return True

    def dead(self, ranks):
        return [r for r in ranks if r in self.killed]

    def cpu_seconds(self, ranks):
        return None  # nothing to look at: the job falls back on its release delay

    def exit_status(self, rank):
        return None

    def how_ended(self, rank):
        return ""

    def note_memory(self):
        pass


class Live:
    def update(self, *args, **kwargs) -> None:
        pass


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    """The real delays are seconds; the same escalation in tenths."""
    monkeypatch.setattr(job_module, "PEER_GRACE_S", 0.1)
    monkeypatch.setattr(job_module, "KILL_GRACE_S", 0.15)
    monkeypatch.setattr(job_module, "RELEASE_S", 0.05)
    monkeypatch.setattr(job_module, "LIVENESS_EVERY_S", 0.01)
    monkeypatch.setattr(job_module, "LAST_METRICS_WAIT_S", 0.05)
    monkeypatch.setattr(torch_ddp, "peer_release_s", lambda options: 0.05)
    monkeypatch.setattr(torch_ddp, "collective_timeout", lambda options: 0.3)


def _run(cluster: Cluster, line: str = ""):
    specs = [
        RankSpec(run_id=1, framework="torch", source="x", filename="<cell>", rank=r,
                 world_size=cluster.size, local_rank=r, local_world_size=cluster.size, env={})
        for r in range(cluster.size)
    ]  # fmt: skip
    job = Job(cluster, specs, opts=parse_run_options(line), live=Live(), out=_Null(),
              err=_Null(), world=cluster.size, clock=cluster.clock)  # fmt: skip
    start = cluster.clock.now
    outcome = job.watch_until_done()
    job.finish(outcome)
    return outcome, cluster.clock.now - start


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def test_a_rank_that_raises_frees_the_one_waiting_in_a_collective_without_signals():
    cluster = Cluster([Rank(ends_after=0.05, fails="ValueError"), Rank(in_collective=True)])
    outcome, took = _run(cluster)
    assert outcome.watch.reason == Reason.FAILURE
    assert cluster.calls == [("release", (0,))]  # rank 0 let go of the group: rank 1 was freed
    assert [f.exc_type for f in outcome.failures] == ["ValueError", "RuntimeError"]
    assert outcome.lost == [] and outcome.stopped == [] and outcome.left == {0}
    assert job_module.states(outcome.ars, outcome.watch) == [RankState.FAILED] * 2
    assert took < 5.0


def test_a_rank_whose_release_failed_is_not_counted_as_having_left():
    """Only a rank that said it left the group is left out of the settling's rebuild; one whose
    release raised (or is still running) is asked again there, and replaced if it cannot."""
    cluster = Cluster(
        [Rank(ends_after=0.05, fails="ValueError", release_fails=True), Rank(in_collective=True)]
    )
    outcome, _ = _run(cluster)
    assert cluster.calls == [("release", (0,))]
    assert outcome.left == set() and outcome.released == set()


def test_timeout_interrupts_at_once_and_kills_the_rank_that_ignores_it():
    cluster = Cluster([Rank(), Rank(ignores_interrupt=True)])
    outcome, took = _run(cluster, "--timeout 0.2")
    assert outcome.watch.reason == Reason.TIMEOUT
    # Interrupt every rank; rank 0 stops and lets go of the group (which would free a peer
    # blocked in a collective); rank 1 ignored the interrupt and is killed.
    assert cluster.calls == [("interrupt", (0, 1)), ("release", (0,)), ("kill", (1,))]
    assert outcome.watch.killed == [1] and outcome.lost == [1] and outcome.watch.dead == []
    assert outcome.stopped == [0, 1]  # rank 0 stopped on the interrupt, rank 1 was killed
    # The interrupt at the timeout (0.2 s), the kill the grace later (0.05 + 0.15 s): no sooner.
    assert 0.2 + 0.2 <= took < 5.0


def test_a_rank_that_is_not_nbdists_to_kill_is_given_up_after_the_collective_timeout():
    cluster = Cluster([Rank(), Rank(ignores_interrupt=True)], kills=False)
    outcome, took = _run(cluster, "--timeout 0.2")
    assert outcome.watch.abandoned == [1] and outcome.watch.killed == [] and outcome.lost == []
    assert ("kill", (1,)) in cluster.calls and not cluster.killed
    assert 0.2 + 0.2 + 0.3 <= took < 5.0  # and the collective timeout after the kill grace
    assert outcome.stopped == [0]  # still running: not called stopped


def test_a_second_interrupt_kills_at_once():
    cluster = Cluster([Rank(ignores_interrupt=True), Rank(ignores_interrupt=True)])
    interrupt = lambda: os.kill(os.getpid(), signal.SIGINT)  # noqa: E731
    cluster.clock.at(0.1, interrupt)
    cluster.clock.at(0.3, interrupt)  # past the peer grace (0.1 s), well before the kill grace

    job_module.KILL_GRACE_S = 5.0  # restored by the fixture: only a second interrupt kills now
    outcome, took = _run(cluster)
    assert outcome.watch.reason == Reason.INTERRUPT
    assert cluster.calls[0] == ("interrupt", (0, 1)) and cluster.calls[-1] == ("kill", (0, 1))
    assert took < 4.0  # not the 5 s kill grace


def test_two_interrupts_that_arrive_before_the_watch_loop_looks_are_two():
    """Seen in a TensorFlow fit: the notebook's main thread was importing when both arrived,
    and a flag made them one, so the second interrupt did not stop the ranks at once."""
    with job_module._sigint_counted() as interrupts:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs here, in the main thread
        assert [interrupts.take() for _ in range(3)] == [True, True, False]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_engine_that_dies_mid_job_is_seen_and_the_others_freed():
    cluster = Cluster([Rank(in_collective=True), Rank(dies_after=0.1)])
    outcome, took = _run(cluster)
    assert outcome.watch.reason == Reason.DIED
    assert outcome.watch.dead == [1] and outcome.lost == [1] and outcome.watch.killed == []
    assert cluster.calls == [("interrupt", (0, 1))]  # the survivor waits on a dead peer: stopped
    assert outcome.stopped == [0]
    assert took < 5.0


def test_an_engine_ipyparallel_calls_dead_before_its_process_is_gone_is_dead():
    """Seen in a CI run: the task of an engine the out-of-memory killer took failed while its
    process still exited, and the cell ended as an ordinary error."""
    cluster = Cluster([Rank(ends_after=0.02), Rank(unregistered_before_gone=(0.1, 0.4))])
    outcome, took = _run(cluster)
    assert outcome.watch.dead == [1] and outcome.lost == [1] and outcome.watch.killed == []
    assert 0.5 <= took < 5.0


def test_ranks_that_all_finish_are_left_alone():
    cluster = Cluster([Rank(ends_after=0.02), Rank(ends_after=0.05)])
    outcome, _ = _run(cluster)
    assert outcome.watch.reason is None and cluster.calls == []
    assert sorted(outcome.reports) == [0, 1] and outcome.failures == []
