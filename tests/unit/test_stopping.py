"""The graceful stop's agreement (nbdist.engine.stopping), rank by rank, on an in-memory board.

Ranks are stepped by hand in the orders a real job can take: in lockstep (a collective in
every step keeps them at most one boundary apart), with the stop signal reaching them at
different boundaries.
"""

from __future__ import annotations

import pytest

from nbdist.engine.stopping import StopAtStep, Stopper


class MemoryBoard:
    margin = 1

    def __init__(self) -> None:
        self.steps: dict[int, int] = {}

    def publish(self, rank: int, step: int) -> None:
        assert rank not in self.steps, "a rank publishes once"
        self.steps[rank] = step

    def published(self, ranks: list[int]) -> list[int] | None:
        if not all(r in self.steps for r in ranks):
            return None
        return [self.steps[r] for r in ranks]


def _ranks(n: int) -> tuple[MemoryBoard, list[Stopper]]:
    board = MemoryBoard()
    return board, [Stopper(board, r, list(range(n))) for r in range(n)]


def _step(stopper: Stopper) -> int | None:
    """One optimizer step on ``stopper``'s rank: the boundary it stopped at, if it did."""
    try:
        stopper.boundary("optimizer")
    except StopAtStep as stop:
        return stop.step
    return None


def test_no_request_no_cost_and_no_stop():
    board, (a, b) = _ranks(2)
    for _ in range(100):
        assert _step(a) is None and _step(b) is None
    assert board.steps == {} and a.boundaries == 100


@pytest.mark.parametrize("late_by", [0, 1])
def test_lockstep_ranks_stop_at_the_same_step(late_by):
    """Rank 1 learns of the stop ``late_by`` boundaries after rank 0; each step, rank 0 goes
    first (it may be one boundary ahead, never more)."""
    board, (a, b) = _ranks(2)
    for _ in range(10):
        _step(a), _step(b)
    a.requested = True
    stopped: dict[str, int] = {}
    for i in range(20):
        if i == late_by:
            b.requested = True
        for name, s in (("a", a), ("b", b)):
            if name not in stopped:
                at = _step(s)
                if at is not None:
                    stopped[name] = at
        if len(stopped) == 2:
            break
    assert stopped["a"] == stopped["b"] == max(board.steps.values()) + 1
    assert board.steps == {0: 11, 1: 11 + late_by}


def test_the_boundary_kind_is_the_first_one_the_run_meets():
    board, (a,) = _ranks(1)
    a.boundary("optimizer")
    a.requested = True
    a.boundary("log")  # not counted: this run's steps are optimizer steps
    assert board.steps == {} and a.boundaries == 1
    with pytest.raises(StopAtStep) as info:
        a.boundary("optimizer")  # publishes 2, and being alone knows the target: 3
        a.boundary("optimizer")
    assert (info.value.step, info.value.target) == (3, 3)


def test_an_optimizer_pre_hook_stops_before_the_update_no_rank_takes():
    """Stopped at boundary 3 seen before update 3: two updates completed, as announced."""
    told: list[int] = []
    a = Stopper(MemoryBoard(), 0, [0], announce=told.append)
    a.boundary("optimizer", before=True)
    a.requested = True
    a.boundary("optimizer", before=True)  # publishes 2: the target is 3
    with pytest.raises(StopAtStep) as info:
        a.boundary("optimizer", before=True)
    assert (info.value.step, info.value.target) == (2, 3)
    assert told == [2]


def test_a_rank_past_the_target_stops_where_it_is():
    """No collective in each step: rank 0 ran ahead; it stops at once, at its own step."""
    board, (a, b) = _ranks(2)
    for _ in range(10):
        _step(a)
    a.requested = b.requested = True
    assert _step(a) is None  # publishes 11; rank 1 has not yet
    assert _step(b) is None  # publishes 1: the target is 12, rank 1 goes on
    assert _step(a) == 12  # exactly at the target
    assert [_step(b) for _ in range(11)][-1] == 12
    board2, (c, d) = _ranks(2)
    for _ in range(10):
        _step(c)
    c.requested = True
    for _ in range(5):
        assert _step(c) is None  # published 11, waits for rank 1 without blocking
    d.requested = True
    assert _step(d) is None  # publishes 1: the target is 12, rank 0 is at 15 already
    with pytest.raises(StopAtStep) as info:
        c.boundary("optimizer")
    assert (info.value.step, info.value.target) == (16, 12)


def test_the_graceful_wait_grows_with_the_slowest_ranks_steps():
    from nbdist.kernel.job import GRACEFUL_WAIT_MAX_S, GRACEFUL_WAIT_S, graceful_wait

    def points(rank, step_s, n=8, t0=100.0):
        return [{"rank": rank, "step": i, "time": t0 + i * step_s} for i in range(n)]

    fast = points(0, 0.01) + points(1, 0.02)
    assert graceful_wait(fast, 2) == GRACEFUL_WAIT_S
    assert graceful_wait([{"rank": 0, "step": 0, "time": 5.0}], 2) == GRACEFUL_WAIT_S  # no step
    slow = points(0, 0.01) + points(1, 2.0)  # rank 1 takes 2 s a step: three of them
    assert graceful_wait(slow, 2) == 6.0
    # The last five intervals only: a slow first step (compilation) does not count.
    compiled = [{"rank": 0, "step": 0, "time": 0.0}] + points(0, 0.5, t0=60.0)
    assert graceful_wait(compiled, 1) == GRACEFUL_WAIT_S
    assert graceful_wait(points(0, 100.0), 1) == GRACEFUL_WAIT_MAX_S


class MissingBoard(MemoryBoard):
    """A board whose look misses a finished publish ``misses`` times for each rank that looks
    (TensorFlow's get timing out on a busy machine), with the board's ``margin``."""

    def __init__(self, margin: int, misses: int) -> None:
        super().__init__()
        self.margin = margin
        self.misses = misses
        self.missed: dict[int, int] = {}

    def look(self, rank: int, ranks: list[int]) -> list[int] | None:
        steps = self.published(ranks)
        if steps is not None and self.missed.get(rank, 0) < self.misses:
            self.missed[rank] = self.missed.get(rank, 0) + 1
            return None
        return steps


def _lockstep_stop(board: MissingBoard) -> dict[int, int]:
    """Two ranks in lockstep, rank 1 learning of the stop one boundary after rank 0: the
    boundary each rank stopped at."""

    class Looking:
        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.margin = board.margin

        def publish(self, rank: int, step: int) -> None:
            board.publish(rank, step)

        def published(self, ranks: list[int]) -> list[int] | None:
            return board.look(self.rank, ranks)

    a, b = (Stopper(Looking(r), r, [0, 1]) for r in (0, 1))
    for _ in range(10):
        _step(a), _step(b)
    a.requested = True
    stopped: dict[int, int] = {}
    for i in range(20):
        b.requested = b.requested or i == 1
        for rank, s in ((0, a), (1, b)):
            if rank not in stopped and (at := _step(s)) is not None:
                stopped[rank] = at
        if len(stopped) == 2:
            break
    return stopped


def test_a_look_that_misses_a_publish_needs_a_margin():
    """TensorFlow's look can miss a publish that has finished: with a margin of 1 the ranks
    then stop one step apart (and would wait in mismatched collectives), with 2 they agree."""
    assert _lockstep_stop(MissingBoard(margin=1, misses=0)) == {0: 13, 1: 13}
    assert _lockstep_stop(MissingBoard(margin=1, misses=1)) == {0: 14, 1: 13}
    assert _lockstep_stop(MissingBoard(margin=2, misses=1)) == {0: 14, 1: 14}


def test_the_boards_margins():
    from nbdist.engine.stopping import KeyValueBoard, OneRank, StoreBoard

    assert (StoreBoard.margin, OneRank.margin, KeyValueBoard.margin) == (1, 1, 2)


def test_a_stop_key_that_is_not_a_step_is_ignored_with_a_warning():
    """On the host network another local user can reach the group's store: a value written
    under this run's key that is not a step is not an exception in every optimizer step."""
    from nbdist.engine.stopping import StoreBoard

    class Store:
        def __init__(self):
            self.data = {}

        def set(self, key, value):
            self.data[key] = value.encode()

        def check(self, keys):
            return all(k in self.data for k in keys)

        def get(self, key):
            return self.data[key]

    store = Store()
    board = StoreBoard(store, "n0nce")
    board.publish(0, 4)
    assert board.published([0, 1]) is None  # rank 1 has not published
    store.data["nbdist-stop/n0nce/1"] = b"rm -rf"
    with pytest.warns(RuntimeWarning, match="ignored nbdist-stop/n0nce/1: its value is not a step"):
        assert board.published([0, 1]) is None
    store.data["nbdist-stop/n0nce/1"] = b"-3"
    assert board.published([0, 1]) is None  # said once per key; not a step either
    board.publish(1, 5)
    assert board.published([0, 1]) == [4, 5]
