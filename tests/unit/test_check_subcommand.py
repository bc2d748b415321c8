"""%distrain check SOURCE takes the code as typed and says when it does not parse.

Each test runs the magic of its own never-started cluster (the ``stopped`` fixture): what the
checker is told (the world size, the workers' GPUs) then comes from no other test's cluster,
and checking starts nothing.
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from nbdist.engine.hardware import visible_gpus


def test_quotes_are_kept(stopped, capsys):
    magics, nothing_started = stopped
    # Split and re-joined by shlex this became print(a b), which does not parse.
    magics.distrain("check print(\"a b\"); x = 'c  d'")
    assert capsys.readouterr().out == "nbdist check: no distributed-training mistakes found\n"
    nothing_started()


@pytest.mark.skipif(bool(visible_gpus()), reason="this machine has GPUs: nccl is fine")
def test_finding_in_quoted_code(stopped, capsys):
    magics, nothing_started = stopped
    magics.distrain("check dist.init_process_group('nccl')")
    assert capsys.readouterr().out.startswith("nbdist check [nccl-without-gpu] line 1:")
    nothing_started()


def test_code_that_does_not_parse_is_said_so(stopped, capsys):
    magics, _ = stopped
    magics.distrain("check print(a b)")
    assert capsys.readouterr().out == (
        "nbdist check: the code does not parse (line 1: invalid syntax. Perhaps you forgot a "
        "comma?); nothing was checked\n"
    )


def test_unbalanced_quote_is_code_not_a_split_error(stopped, capsys):
    magics, _ = stopped
    magics.distrain("check print('a)")
    assert capsys.readouterr().out.startswith("nbdist check: the code does not parse (line 1: ")


def test_variable_holding_code(shell, stopped, capsys):
    magics, _ = stopped
    shell.user_ns["cell_text"] = "for x in range(3)\n    pass\n"
    magics.distrain("check cell_text")
    assert capsys.readouterr().out == (
        "nbdist check: the code does not parse (line 1: expected ':'); nothing was checked\n"
    )


def test_check_without_source(stopped):
    magics, _ = stopped
    with pytest.raises(UsageError, match="%distrain check needs code or the name of a string"):
        magics.distrain("check   ")


def test_check_only_sees_the_functions_of_the_sessions_earlier_cells(stopped, capsys):
    """PyTorch's DDP tutorial: run_demo() (with its mp.spawn) defined in one cell, called in the
    next; the session keeps the cells that ran, and --check-only reads the call through them."""
    from nbdist.kernel.export import CellRecord

    magics, nothing_started = stopped
    earlier = (
        "import torch.multiprocessing as mp\n\n"
        "def run_demo(demo_fn, world_size):\n"
        "    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)\n"
    )
    magics.session.cells.append(
        CellRecord(source=earlier, framework="torch", world_size=2, autolog=True)
    )
    magics.distrain("--check-only", "run_demo(demo_basic, 2)\n")
    assert capsys.readouterr().out.startswith(
        f"nbdist check [spawn-in-cell] Cell In[{magics.shell.execution_count}], line 2: in "
        "run_demo(), defined in an earlier cell (its line 5): mp.spawn(...) starts worker "
        "processes from a %%distrain cell"
    )
    nothing_started()
