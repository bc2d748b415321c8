"""The session's line magics reject bad input with a UsageError before any engine is involved."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from nbdist.kernel.magic import DistrainMagics


@pytest.fixture
def idle(shell):
    """A DistrainMagics of its own, whose cluster was never started."""
    magics = DistrainMagics(shell)
    yield magics
    magics.close()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("reset now", "unrecognized arguments: now"),
        ("pull", "the following arguments are required: names"),
        ("pull 1x", "pull takes comma-separated variable names"),
        ("pull w --rank x", "argument --rank: invalid int value: 'x'"),
        ("compare", "the following arguments are required: name"),
        ("compare a,b", "compare takes one variable name, e.g. compare model"),
        ("auto maybe", "argument mode: invalid choice: 'maybe'"),
        ("export train.txt", "'train.txt' should be a .py file, e.g. train.py"),
        ("export /nonexistent-folder/train.py", "no folder /nonexistent-folder; create it first"),
    ],
)
def test_bad_input_says_what_to_type(idle, line, message):
    with pytest.raises(UsageError, match=message.replace(".", r"\.").replace("(", r"\(")):
        idle._subcommand(line)


@pytest.mark.parametrize("command", ["reset", "pull w", "vars", "compare model"])
def test_commands_that_need_workers_say_how_to_start_them(idle, command):
    name = command.split()[0]
    with pytest.raises(
        UsageError,
        match=rf"%distrain {name}: no workers are running; run a %%distrain cell \(or "
        r"%distrain start\) first\.",
    ):
        idle._subcommand(command)


def test_push_names_the_missing_variable_first(idle, shell):
    shell.user_ns.pop("nothere", None)
    with pytest.raises(UsageError, match="push nothere: no variable 'nothere' in the notebook"):
        idle._subcommand("push nothere")


def test_export_with_nothing_run_says_so(idle, tmp_path):
    with pytest.raises(UsageError, match="no %%distrain cell has run since the workers were"):
        idle._subcommand(f"export {tmp_path / 'train.py'}")


def test_export_after_only_a_push_says_so(idle, tmp_path):
    """%distrain push records itself for the script, but a push alone is no training to export."""
    from nbdist.kernel.export import CellRecord

    idle.session.cells = [
        CellRecord(source="", kind="push", push={"data": [1, 2]}, framework="torch",
                   world_size=2, autolog=False)
    ]  # fmt: skip
    with pytest.raises(UsageError) as info:
        idle._subcommand(f"export {tmp_path / 'train.py'}")
    assert str(info.value) == (
        "%distrain export: no %%distrain cell has run since the workers were last reset. "
        "(Run the cells, then %distrain export train.py.)"
    )
    assert list(tmp_path.iterdir()) == []


def test_auto_mode_prefixes_plain_cells_only(idle, shell):
    assert idle._transform in shell.input_transformers_cleanup
    idle._subcommand("auto on")
    try:
        assert idle._transform(["x = 1\n"]) == ["%%distrain\n", "x = 1\n"]
        assert idle._transform(["%%local\n", "x = 1\n"]) == ["x = 1\n"]
        assert idle._transform(["%distrain auto off\n"]) == ["%distrain auto off\n"]
    finally:
        idle._subcommand("auto off")
    assert idle._transform(["x = 1\n"]) == ["x = 1\n"]
    assert idle._transform(["%%local\n"]) == ["\n"]
