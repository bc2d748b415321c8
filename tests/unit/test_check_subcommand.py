"""%distrain check SOURCE takes the code as typed and says when it does not parse."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError


def test_quotes_are_kept(shell, capsys):
    # Split and re-joined by shlex this became print(a b), which does not parse.
    shell.run_line_magic("distrain", "check print(\"a b\"); x = 'c  d'")
    assert capsys.readouterr().out == "nbdist check: no distributed-training mistakes found\n"


def test_finding_in_quoted_code(shell, capsys):
    shell.run_line_magic("distrain", "check dist.init_process_group('nccl')")
    assert capsys.readouterr().out.startswith("nbdist check [nccl-without-gpu] cell line 1:")


def test_code_that_does_not_parse_is_said_so(shell, capsys):
    shell.run_line_magic("distrain", "check print(a b)")
    assert capsys.readouterr().out == (
        "nbdist check: the code does not parse (line 1: invalid syntax. Perhaps you forgot a "
        "comma?); nothing was checked\n"
    )


def test_unbalanced_quote_is_code_not_a_split_error(shell, capsys):
    shell.run_line_magic("distrain", "check print('a)")
    assert capsys.readouterr().out.startswith("nbdist check: the code does not parse (line 1: ")


def test_variable_holding_code(shell, capsys):
    shell.user_ns["cell_text"] = "for x in range(3)\n    pass\n"
    shell.run_line_magic("distrain", "check cell_text")
    assert capsys.readouterr().out == (
        "nbdist check: the code does not parse (line 1: expected ':'); nothing was checked\n"
    )


def test_check_without_source(shell):
    with pytest.raises(UsageError, match="%distrain check needs code or the name of a string"):
        shell.run_line_magic("distrain", "check   ")
