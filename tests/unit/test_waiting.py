"""Where a rank's cell is: the place the engine's sampler thread reports while the cell runs."""

from __future__ import annotations

import sys
import threading

from nbdist.engine.waiting import WhereReporter, place
from nbdist.engine.worker import run_source
from nbdist.protocol import WHERE_KEY, Waiting

CELL = "<%%distrain cell 99>"


def test_place_is_the_cells_innermost_line():
    frame = run_source("x = 1\ngrab()\n", CELL, {"grab": sys._getframe})
    assert place(frame, CELL) == Waiting(line=2, line_text="grab()", collective=None)


def test_no_place_outside_the_cell():
    assert place(sys._getframe(), CELL) is None


def test_reporter_publishes_a_place_held_for_two_samples():
    published, release = [], threading.Event()

    def wait_here():
        reporter = WhereReporter(published.append, CELL)
        reporter.start()
        # The cell's thread holds one line until the reporter has said where it is.
        run_source("released = release.wait(10)\n", CELL, {"release": release})
        reporter.close()

    worker = threading.Thread(target=wait_here)
    worker.start()
    for _ in range(200):  # the cell's line is released once published, or after 10 s
        if published:
            break
        release.wait(0.05)
    release.set()
    worker.join()
    assert published[0] == {
        WHERE_KEY: Waiting(line=1, line_text="released = release.wait(10)", collective=None)
    }
