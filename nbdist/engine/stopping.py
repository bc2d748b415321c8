"""Graceful stop: every rank of a run stops at the same step boundary, and the session goes on.

The notebook's Stop button (or one Kernel > Interrupt) sends :data:`STOP_SIGNAL` to every rank
of a run whose backend has a board (:func:`board`); its handler only sets a flag. Then:

1. At each **step boundary** — an optimizer step, a Keras batch, a ``log(...)`` call: the first
   of these kinds the run meets is the one counted — a rank whose flag is set publishes, once,
   the number of the boundary it is at on the board (torch: the group's TCPStore), and trains
   on; it never waits for the board.
2. At each later boundary it looks (without waiting long) whether every rank of the run has
   published. Once all have, the target is ``T = max(published) + margin``; the rank raises
   :class:`StopAtStep` when it reaches boundary ``T``. An optimizer's boundary is its
   pre-hook: the stop comes before update ``T``, so the loop body of step ``T - 1`` ran to its
   end (its bookkeeping after ``opt.step()`` included) on every rank, and no rank took update
   ``T``. A Keras batch ends with ``stop_training``, after the batch.

Why it cannot deadlock: no rank waits on the board longer than one look; every rank keeps
stepping until it knows ``T``. In a job with a collective in each step the ranks are at most
one boundary apart (a rank cannot finish step ``s + 1``'s all-reduce before each peer has
finished step ``s``), so when the last rank publishes ``s``, every other rank is at
``s + 1 <= T`` or before: each reaches ``T``, and none is left in a collective of a step its
peers do not take. That needs each rank to see the last publish by boundary ``T``: a board
whose look always sees a finished publish (a TCPStore's ``check``) has a margin of 1; one
whose look can miss it (TensorFlow's key-value get, which gives up after a timeout however
near the key is) has a larger margin, so that a rank gets that many looks before ``T``.

A rank that finds itself past ``T`` (a loop without a per-step collective, so no lockstep)
stops where it is and says so; the notebook names the different steps. A rank that reaches no
boundary (blocked in a data loader, or in a collective with a rank that does not step) is
interrupted by the notebook after its graceful wait, the old way.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any, Protocol

STOP_SIGNAL = signal.SIGUSR1
KEY = "nbdist-stop/{run}/{rank}"  # run: the run's nonce (RankSpec.nonce), fresh per cell


class StopAtStep(BaseException):  # noqa: N818 - raised like KeyboardInterrupt, not an error
    """Raised at the agreed step boundary: ends the cell on this rank, the session kept.

    A ``BaseException``, as ``KeyboardInterrupt`` is, so that a cell's ``except Exception``
    around its loop does not swallow it.
    """

    def __init__(self, step: int, target: int) -> None:
        super().__init__(f"stopped at step {step} (target {target})")
        self.step = step
        self.target = target


class Board(Protocol):
    """Where the ranks of one run publish the boundary each was at when it learned of the stop.
    Neither method may block for long: they run inside the training loop.

    ``margin``: how many boundaries past the last publish the run stops; 1 where
    :meth:`published` never misses a publish that has returned, more where it can."""

    margin: int

    def publish(self, rank: int, step: int) -> None: ...

    def published(self, ranks: list[int]) -> list[int] | None:
        """Every rank's step once all of ``ranks`` have published, else None."""
        ...


class StoreBoard:
    """A board on a torch ``Store`` (the group's TCPStore): keys per run and rank."""

    margin = 1  # check() answers from the store itself: a finished set() is always seen

    def __init__(self, store: Any, run: str) -> None:
        self.store = store
        self.run = run
        self._bad: set[str] = set()  # keys whose value did not parse, said once each

    def _key(self, rank: int) -> str:
        return KEY.format(run=self.run, rank=rank)

    def publish(self, rank: int, step: int) -> None:
        self.store.set(self._key(rank), str(step))

    def published(self, ranks: list[int]) -> list[int] | None:
        keys = [self._key(r) for r in ranks]
        if not self.store.check(keys):
            return None
        steps = [_step(self.store.get(k)) for k in keys]
        bad = [k for k, s in zip(keys, steps, strict=True) if s is None]
        if bad:
            # Only this run's ranks write these keys; on the host network another local user
            # can reach the store and write one. Not a step: not published, and no exception
            # in every optimizer step (the notebook interrupts the ranks after its wait).
            for key in set(bad) - self._bad:
                warnings.warn(
                    f"nbdist: the graceful stop ignored {key}: its value is not a step (written "
                    "by something else than this run's ranks)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            self._bad.update(bad)
            return None
        return [s for s in steps if s is not None]  # (all of them)


def _step(value: Any) -> int | None:
    """A published value as a step (a non-negative integer), or None."""
    try:
        text = value.decode() if isinstance(value, bytes) else str(value)
        step = int(text)
    except (UnicodeDecodeError, ValueError):
        return None
    return step if step >= 0 else None


class KeyValueBoard:
    """A board on TensorFlow's coordination service (the key-value store every worker of a
    ``MultiWorkerMirroredStrategy`` reaches). TensorFlow has no non-blocking look: a get waits
    up to ``CHECK_MS`` for a key, and gives up as well when the answer about a key that is there
    takes longer (a loaded machine: a 1 ms look missed finished publishes, and a CI run's ranks
    stopped one batch apart, then failed in mismatched collectives). Hence the margin: a rank
    has two looks, a step apart, before the target."""

    CHECK_MS = 100
    margin = 2

    def __init__(self, context: Any, run: str) -> None:
        self.context = context  # tensorflow.python.eager.context.context()
        self.run = run

    def _key(self, rank: int) -> str:
        return KEY.format(run=self.run, rank=rank)

    def publish(self, rank: int, step: int) -> None:
        self.context.set_config_key_value(self._key(rank), str(step))

    def published(self, ranks: list[int]) -> list[int] | None:
        steps = []
        for r in ranks:
            try:
                steps.append(int(self.context.get_config_key_value(self._key(r), self.CHECK_MS)))
            except Exception:  # noqa: BLE001 - not published yet (DeadlineExceeded, NotFound)
                return None
        return steps


class OneRank:
    """The board of a run on one rank: it agrees with itself."""

    margin = 1

    def __init__(self) -> None:
        self.steps: dict[int, int] = {}

    def publish(self, rank: int, step: int) -> None:
        self.steps[rank] = step

    def published(self, ranks: list[int]) -> list[int] | None:
        return [self.steps[r] for r in ranks] if all(r in self.steps for r in ranks) else None


class Stopper:
    """One rank's part of the graceful stop, for one run."""

    def __init__(
        self,
        board: Board,
        rank: int,
        ranks: list[int],
        announce: Callable[[int], None] | None = None,
    ) -> None:
        self.board = board
        self.rank = rank
        self.ranks = ranks  # every rank that runs the cell
        self.announce = announce  # told the step the run will stop after, once agreed
        self.requested = False  # set by the signal handler
        self.kind: str | None = None  # the boundary kind this run counts
        self.boundaries = 0
        self.published_at: int | None = None
        self.target: int | None = None
        self.stopped_at: int | None = None

    def boundary(self, kind: str, *, before: bool = False) -> None:
        """A step boundary of ``kind`` ("optimizer", "batch", "log") was reached: after a step,
        or (``before``) just before one's update, as an optimizer's pre-hook sees it."""
        if self.kind is None:
            self.kind = kind
        elif kind != self.kind:
            return
        self.boundaries += 1
        if not self.requested:
            return
        here = self.boundaries
        if self.published_at is None:
            self.published_at = here
            self.board.publish(self.rank, here)
        if self.target is None:
            steps = self.board.published(self.ranks)
            if steps is None:
                return
            self.target = max(steps) + self.board.margin
            if self.announce is not None:
                self.announce(self.target - 1 if before else self.target)
        if here >= self.target:
            self.stopped_at = here - 1 if before else here  # the steps this cell completed
            raise StopAtStep(self.stopped_at, self.target)


_lock = threading.Lock()
_current: Stopper | None = None
_installed = False


def _on_signal(signum: int, frame: Any) -> None:
    stopper = _current
    if stopper is not None:
        stopper.requested = True


def ignore_until_the_first_cell() -> None:
    """At the engine's start: :data:`STOP_SIGNAL` ignored, not yet handled.

    The processes an engine starts inherit an ignored signal across ``exec``, but not a
    handler: ipyparallel's nanny, which each engine starts as it registers, so keeps ignoring
    it. Slurm sends its time-limit warning to every process of the job step, and a nanny that
    died of it failed its engine's registration ("nanny failed") or left a running engine
    without its control channel. The first cell installs the handler (:func:`begin`); between
    runs a stop request means nothing anyway."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(STOP_SIGNAL, signal.SIG_IGN)


def install() -> None:
    """Take :data:`STOP_SIGNAL` for good (its default would end the engine): between runs a
    stop request is ignored. Main thread only; elsewhere a no-op."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(STOP_SIGNAL, _on_signal)
    # Restart system calls the signal lands in (a collective's socket read): the flag is read
    # at the next boundary anyway, and a native call that sees EINTR may fail the collective.
    signal.siginterrupt(STOP_SIGNAL, False)
    _installed = True


def begin(stopper: Stopper | None) -> None:
    """Make ``stopper`` the running cell's (None: this run cannot stop gracefully)."""
    global _current
    install()
    with _lock:
        _current = stopper


def end() -> Stopper | None:
    """The run is over: later requests are ignored. Returns the run's stopper."""
    global _current
    with _lock:
        stopper, _current = _current, None
    return stopper


def boundary(kind: str, *, before: bool = False) -> None:
    """Called by the backends' hooks and ``log()`` at each step boundary (cheap when no stop
    was asked for: one attribute read)."""
    stopper = _current
    if stopper is not None:
        stopper.boundary(kind, before=before)
