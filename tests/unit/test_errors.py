from nbdist.errors import RankFailure, WorkerError


def _failure(rank, exc_type="ValueError", message="boom", t=1.0, tb=None):
    return RankFailure(
        rank=rank,
        host="h",
        exc_type=exc_type,
        message=message,
        traceback=tb or f"Traceback:\n  line 3\n{exc_type}: {message}\n",
        line=3,
        line_text="    raise ValueError('boom')",
        time=t,
    )


def test_one_rank_fails_peer_is_collateral():
    err = WorkerError(
        [
            _failure(1, t=1.0),
            _failure(0, "RuntimeError", "Connection reset by peer", t=1.2),
        ]
    )
    assert err.ranks == [1]
    assert (
        str(err)
        == "rank 1 (host h) raised ValueError: boom\n"
        "  at the cell, line 3: raise ValueError('boom')"
    )
    rendered = err._render_traceback_()
    assert rendered.count("--- remote traceback, rank 1 ---") == 1
    assert "rank 0 stopped because a peer failed." in rendered
    assert not any("Connection reset" in line for line in rendered[1:])


def test_identical_failures_are_shown_once():
    err = WorkerError([_failure(0, t=1.0), _failure(1, t=1.0001)])
    assert err.ranks == [0, 1]
    rendered = err._render_traceback_()
    assert rendered[0] == "WorkerError: ranks 0, 1 (host h) raised ValueError: boom"
    assert sum(line.startswith("--- remote traceback") for line in rendered) == 1
    assert "--- remote traceback, ranks 0, 1 ---" in rendered


def test_different_failures_are_shown_apart():
    err = WorkerError([_failure(0, message="a", t=1.0), _failure(1, message="b", t=1.1)])
    assert err.ranks == [0, 1]
    assert sum(line.startswith("--- remote traceback") for line in err._render_traceback_()) == 2


def test_stopped_ranks_are_listed():
    err = WorkerError([_failure(0)], stopped=[2, 1])
    assert "ranks 1, 2 stopped because a peer failed." in err._render_traceback_()
