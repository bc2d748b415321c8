"""The engine's side of ``%distrain debug`` and ``%distrain where``: a failed cell's frames
kept, pdb fed one line at a time, each rank's last stack; and the panel's "where" text.

The cells run through the worker's own ``run_source`` (the code every rank runs), named as
the engine names them, so tracebacks and pdb read ``Cell In[7]``.
"""

from __future__ import annotations

import sys

import pytest

from nbdist.engine import debugging
from nbdist.engine.state import engine_state
from nbdist.engine.worker import _from_cell, run_source

CELL = "<nbdist cell 901>"
SOURCE = """def scale(values, factor):
    total = 0
    for v in values:
        total += v * factor
        if total > 5:
            raise ValueError(f"too big: {total}")
    return total

limit = 5
scale([1, 2, 3], 2)
"""


@pytest.fixture
def failed():
    """SOURCE run as cell In[7] (its first line is the editor's line 2), failed and kept."""
    engine_state().cell_labels[CELL] = "Cell In[7]"
    namespace: dict = {"__name__": "__main__"}
    try:
        run_source(SOURCE, CELL, namespace, first_line=2)
    except ValueError as e:
        debugging.keep(_from_cell(e, CELL), f"ValueError: {e}", "Cell In[7]")
    yield namespace
    debugging.forget()
    engine_state().cell_labels.pop(CELL, None)


def test_post_mortem_at_the_frame_that_raised(failed):
    opened = debugging.open_debugger()
    assert opened.text.splitlines() == [
        "Cell In[7]: ValueError: too big: 6",
        "> Cell In[7](7)scale()",
        '-> raise ValueError(f"too big: {total}")',
    ]
    assert (opened.prompt, opened.ended) == ("Pdb ", False)
    assert debugging.command("p total, v, factor").text == "(6, 2, 2)\n"
    assert debugging.command("up").text.splitlines() == [
        "> Cell In[7](11)<module>()",
        "-> scale([1, 2, 3], 2)",
    ]
    assert debugging.command("p limit").text == "5\n"
    # interact: a console in the frame's variables, fed the same way; exit() goes back.
    assert debugging.command("interact").prompt == ">>> "
    assert debugging.command("for i in range(2):").prompt == "... "
    body = debugging.command("    print(i * limit)")
    assert body.prompt == "... " and body.text == ""
    done = debugging.command("")
    assert (done.text, done.prompt) == ("0\n5\n", ">>> ")
    err = debugging.command("1/0")
    assert err.text.splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert "debugging.py" not in err.text and "code.py" not in err.text
    assert debugging.command("exit()").prompt == "Pdb "
    assert (
        debugging.command("p nothing_here").text
        == "*** NameError: name 'nothing_here' is not defined\n"
    )
    ended = debugging.command("q")
    assert ended.ended and ended.prompt == "ended"
    # The frames stay for another %distrain debug, which starts again where it raised.
    assert debugging.held() == "ValueError: too big: 6"
    assert debugging.open_debugger().text.splitlines()[1] == "> Cell In[7](7)scale()"


def test_where_names_how_the_cell_ended_with_its_lines_first(failed):
    assert debugging.where() == (
        "raised ValueError: too big: 6\n"
        "  Cell In[7], line 11, in <module>: scale([1, 2, 3], 2)\n"
        '  Cell In[7], line 7, in scale: raise ValueError(f"too big: {total}")'
    )


def test_the_next_cell_lets_the_frames_go(failed):
    debugging.forget()
    assert debugging.held() is None and debugging.where() is None
    reply = debugging.open_debugger()
    assert reply.ended
    assert reply.text == (
        "this engine holds no failed cell's frames (none failed here, or a cell ran since)"
    )


def test_a_library_frame_below_the_cell_is_shown_short(failed):
    """A stop inside a library call: its frames after the cell's, site-packages cut off."""
    import json

    engine_state().cell_labels[CELL] = "Cell In[8]"
    try:
        run_source("json.loads('{')\n", CELL, {"json": json}, first_line=2)
    except ValueError as e:
        debugging.keep(_from_cell(e, CELL), "JSONDecodeError", "Cell In[8]")
    lines = debugging.where().splitlines()
    assert lines[:2] == [
        "raised JSONDecodeError",
        "  Cell In[8], line 2, in <module>: json.loads('{')",
    ]
    assert lines[2].startswith("    json/__init__.py:") and lines[2].endswith(", in loads")
    assert all(not line.startswith("    /") for line in lines[2:])


@pytest.mark.parametrize("channel", [None, ("/nonexistent/nbdist-bp/s", b"key")])
def test_breakpoint_without_the_notebooks_socket_is_said_once_per_line(failed, capsys, channel):
    """No channel with the cell, or its socket not on this machine (an engine on another
    host): the breakpoint is said, once per line, and the cell goes on."""
    from nbdist.engine.breakpoints import breakpoints

    engine_state().cell_labels[CELL] = "Cell In[9]"
    with breakpoints(0, channel):
        out = run_source("for i in range(3):\n    breakpoint()\ni\n", CELL, {}, first_line=2)
    assert out == 2
    said = capsys.readouterr().err.splitlines()
    assert said == [
        "nbdist: breakpoint() at Cell In[9], line 3 does not stop a %%distrain cell here (the "
        "notebook's prompt reaches only workers on its own machine); the cell goes on. To look "
        "at the variables at that line: raise there (raise RuntimeError('look')), then "
        "%distrain debug."
    ]
    assert sys.breakpointhook is sys.__breakpointhook__


def test_the_panel_row_says_where_a_rank_waits():
    from nbdist.kernel.curves import Aggregate
    from nbdist.kernel.display import table_html
    from nbdist.protocol import Waiting

    agg = Aggregate(2, start=100.0)
    agg.add([{"rank": r, "step": 0, "time": 100.5, "loss": 1.0} for r in (0, 1)])
    where = {
        0: Waiting(
            line=8, line_text="dist.all_reduce(t)", collective="torch.distributed.all_reduce"
        ),
        1: Waiting(line=7, line_text="x = a < b", collective=None),
    }
    html = table_html(agg, ["running", "running"], now=105.0, where=where)
    assert (
        "<td>running<br><small>waits in torch.distributed.all_reduce, line 8: "
        "dist.all_reduce(t)</small></td>"
    ) in html
    assert "<td>running<br><small>at line 7: x = a &lt; b</small></td>" in html
    assert "<small>" not in table_html(agg, ["running", "running"], now=105.0)


def test_the_notebooks_desk_prompts_for_a_rank_and_refuses_a_wrong_key():
    """The two ends of breakpoint(), in one process: a "rank" (a thread running cell code
    under nbdist.engine.breakpoints) and the notebook's desk, over its real Unix socket."""
    import os
    import stat
    import threading
    import time
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from nbdist.engine.breakpoints import breakpoints
    from nbdist.engine.waiting import place
    from nbdist.kernel.breakpoints import Desk
    from nbdist.protocol import Waiting

    desk = Desk()
    path, key = desk.channel()
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        with pytest.raises(AuthenticationError):
            Client(path, family="AF_UNIX", authkey=b"not the session's key")
        engine_state().cell_labels[CELL] = "Cell In[3]"
        result: dict = {}

        def rank_one() -> None:
            with breakpoints(1, (path, key)):
                run_source("x = 20\nbreakpoint()\ny = x + 1\nz = y * 2\n", CELL, result, 2)

        worker = threading.Thread(target=rank_one)
        worker.start()
        typed = iter(["p x", "n", "p y", "c"])
        prompts: list[str] = []
        shown: list[str] = []
        stops: list[str] = []

        def ask(prompt: str) -> str:
            prompts.append(prompt)
            if len(prompts) == 1:  # where the paused rank is, as the live panel reads it
                frame = sys._current_frames()[worker.ident]
                places.append(place(frame, CELL))
            return next(typed)

        places: list = []

        deadline = time.monotonic() + 20
        while worker.is_alive() and time.monotonic() < deadline:
            desk.serve(shown.append, lambda: stops.append("stop"), ask=ask)
            time.sleep(0.01)
        worker.join(5)
        assert (result["y"], result["z"]) == (21, 42)
        assert prompts == ["(rank 1) Pdb "] * 4
        assert shown == [
            "> Cell In[3](4)<module>()\n-> y = x + 1",
            "20",
            "> Cell In[3](5)<module>()\n-> z = y * 2",
            "21",
        ]
        assert places == [
            Waiting(
                line=4, line_text="y = x + 1", collective="the debugger (the notebook's prompt)"
            )
        ]
        desk.serve(shown.append, lambda: stops.append("stop"), ask=ask)  # the last "resumed"
        assert stops == [] and not desk.active
    finally:
        desk.close()
        engine_state().cell_labels.pop(CELL, None)
    assert not os.path.exists(path)


def test_the_flight_recorders_line_says_who_is_behind():
    from nbdist.kernel.failures import flight_line
    from nbdist.protocol import Stall, Waiting

    def stall(**flights: str | None) -> Stall:
        where = {
            int(r[1:]): None if f is None else Waiting(line=3, line_text="x", flight=f)
            for r, f in flights.items()
        }
        return Stall(ranks=[0], steps={}, idle={}, framework="torch", release_s=1.0, where=where)

    assert flight_line(stall(r0=None, r1=None)) == ""
    assert flight_line(stall(r0="#9 gloo:all_reduce", r1="#9 gloo:all_reduce")) == (
        "torch's flight recorder, each rank's last collective: rank 0 #9 gloo:all_reduce, "
        "rank 1 #9 gloo:all_reduce."
    )
    assert flight_line(
        stall(r2="#12 nccl:all_reduce (started)", r0="#12 nccl:all_reduce (started)",
              r1="#9 nccl:broadcast (completed)")
    ) == (  # fmt: skip
        "torch's flight recorder, each rank's last collective: rank 0 #12 nccl:all_reduce "
        "(started), rank 1 #9 nccl:broadcast (completed), rank 2 #12 nccl:all_reduce "
        "(started) (rank 1 is 3 collectives behind)."
    )


def test_a_rank_that_stops_while_another_is_at_the_prompt_waits_its_turn():
    """Rank 1 is at the notebook's prompt; rank 0 stops at its breakpoint meanwhile. The
    notebook stays with rank 1 until it goes on (``c``), then takes rank 0, though rank 0 is
    the lower. Two "ranks" over the desk's real socket, each step in a known order."""
    from multiprocessing.connection import Client

    from nbdist.kernel.breakpoints import Desk

    desk = Desk()
    path, key = desk.channel()
    one = Client(path, family="AF_UNIX", authkey=key)
    zero = Client(path, family="AF_UNIX", authkey=key)
    prompts: list[str] = []
    typed = iter(["p mine", "c", "p mine", "c"])

    def ask(prompt: str) -> str:
        prompts.append(prompt)
        return next(typed)

    def serve_until(conn, line: str) -> None:  # until that rank was sent ``line``
        for _ in range(500):
            desk.serve(lambda text: None, lambda: None, ask=ask)
            if conn.poll(0.01):
                assert conn.recv() == line
                return
        raise AssertionError(f"{line!r} never sent")

    try:
        one.send(("stop", 1, "", "Pdb "))
        serve_until(one, "p mine")
        zero.send(("stop", 0, "", "Pdb "))  # rank 0 arrives while rank 1 is in its debugger
        one.send(("reply", "10", "Pdb "))
        serve_until(one, "c")
        one.send(("resumed", ""))
        serve_until(zero, "p mine")
        zero.send(("reply", "0", "Pdb "))
        serve_until(zero, "c")
        assert prompts == ["(rank 1) Pdb "] * 2 + ["(rank 0) Pdb "] * 2
    finally:
        one.close()
        zero.close()
        desk.close()
