"""A worker that exits: ``exit()``, ``quit()``, ``sys.exit()`` end the cell and keep the workers;
an engine that dies between cells is named by the next command, and the next cell replaces it."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from IPython.core.error import UsageError

from nbdist import WorkerError
from nbdist.errors import EXIT_NOTE
from tests.cells import cell_in
from tests.procs import gone_or_zombie

pytestmark = [pytest.mark.cluster, pytest.mark.torch]


@pytest.mark.parametrize(
    ("call", "headline"),
    [
        ("exit()", "SystemExit"),
        ("quit(3)", "SystemExit: 3"),
        ("import sys; sys.exit('no GPU here')", "SystemExit: no GPU here"),
    ],
)
def test_exit_ends_the_cell_and_keeps_the_workers(fresh_session, magics, capsys, call, headline):
    sh = fresh_session
    pids = [e.pid for e in magics.cluster.engines]
    sh.run_cell_magic("distrain", "", "kept = rank\n")
    cell = f"print('before')\nif rank == 1:\n    {call}\nprint('after')\n"
    with pytest.raises(WorkerError) as info:
        sh.run_cell_magic("distrain", "", cell)
    error = info.value
    assert str(error).splitlines()[0] == f"rank 1 (host {os.uname().nodename}) raised {headline}"
    assert f"at {cell_in(sh)}, line 4: {call}" in str(error)
    rendered = error._render_traceback_()
    assert EXIT_NOTE in rendered
    assert rendered[-1] == (
        "The workers' variables are kept (kept), as after an error in a Python REPL; fix the "
        "cell and run it again."
    )
    out = capsys.readouterr().out
    assert "[rank 0] after" in out and "[rank 1] after" not in out
    # Nothing died afterwards: the same engines, with the session's variables.
    time.sleep(1)
    assert [e.pid for e in magics.cluster.engines] == pids
    assert all(psutil.pid_exists(p) for p in pids)
    assert sh.run_cell_magic("distrain", "", "kept") is not None
    assert magics.session.variables == ["kept"]


@pytest.fixture
def heal_off(fresh_session):
    """``%distrain heal off``: a dead rank's engines are replaced and the variables lost (the
    healing itself is tests/integration/test_healing.py's)."""
    fresh_session.run_line_magic("distrain", "heal off")
    yield fresh_session
    fresh_session.run_line_magic("distrain", "heal on")


def test_an_engine_killed_between_cells_is_named_and_replaced(heal_off, magics, capsys):
    sh = heal_off
    sh.run_cell_magic("distrain", "", "kept = rank\n")
    victim = magics.cluster.engines[1]
    os.kill(victim.pid, signal.SIGKILL)
    assert gone_or_zombie(victim.pid)
    capsys.readouterr()

    sh.run_line_magic("distrain", "status")
    status = capsys.readouterr().out
    died = "killed by SIGKILL (kill -9, or the kernel's out-of-memory killer)"
    assert f"  {victim.pid:>8}  -     dead: {died}\n" in status
    assert status.rstrip().endswith(
        "The next %%distrain cell replaces the workers (their variables are lost); "
        "%distrain restart does it now."
    )
    with pytest.raises(UsageError) as info:
        sh.run_line_magic("distrain", "vars")
    assert str(info.value) == (
        f"%distrain vars: rank 1 (host {victim.host}, pid {victim.pid}) died after its last "
        f"cell: {died}. The next %%distrain cell replaces the workers (their variables are "
        "lost); %distrain restart does it now."
    )

    assert sh.run_cell_magic("distrain", "-o res", "rank\n") is not None
    out = capsys.readouterr().out
    assert (
        f"nbdist: rank 1 (host {victim.host}, pid {victim.pid}) died after its last cell: "
        f"{died}; replacing the engines\n" in out
    )
    assert (
        "nbdist: the workers were replaced; their variables (kept) are gone: re-run the cells "
        "that build them." in out
    )
    assert sh.user_ns["res"].values == [0, 1]
    assert victim.pid not in [e.pid for e in magics.cluster.engines]
    # The next error does not say "kept" of variables that went with the engines.
    with pytest.raises(WorkerError) as error:
        sh.run_cell_magic("distrain", "", "kept\n")
    assert str(error.value).endswith(
        "The workers hold no variables; fix the cell and run it again."
    ), str(error.value)
