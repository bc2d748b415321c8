import pytest
from IPython.core.error import UsageError


def test_docstring_teaches(shell):
    doc = shell.find_cell_magic("distrain").__doc__
    assert "%%distrain -n 2 -o result" in doc
    assert "--push" in doc and "--pull" in doc and "--timeout" in doc
    assert "%distrain status" in doc


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("", "%distrain needs a subcommand: start [-n N] | stop | restart [-n N] | status"),
        ("launch", "invalid choice: 'launch'"),
        ("start -n 0", "needs at least 1 worker"),
    ],
)
def test_bad_subcommands(shell, line, expected):
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("distrain", line)
    assert expected in str(info.value)


def test_cell_errors_before_any_engine_starts(shell, magics):
    running = magics.cluster.running
    with pytest.raises(UsageError, match="syntax error at cell line 1"):
        shell.run_cell_magic("distrain", "", "for\n")
    with pytest.raises(UsageError, match="the cell is empty"):
        shell.run_cell_magic("distrain", "", "\n")
    with pytest.raises(UsageError, match="--push nothere: no variable 'nothere'"):
        shell.run_cell_magic("distrain", "--push nothere", "import torch\n")
    shell.user_ns["gen"] = (i for i in range(3))
    with pytest.raises(UsageError, match="--push gen: a generator cannot be sent"):
        shell.run_cell_magic("distrain", "--push gen", "import torch\n")
    with pytest.raises(UsageError, match="--backend is for torch cells; drop it for tf"):
        shell.run_cell_magic("distrain", "--backend gloo", "import tensorflow\n")
    with pytest.raises(UsageError, match="--strategy is for TensorFlow cells"):
        shell.run_cell_magic("distrain", "--strategy mirrored --framework torch", "x = 1\n")
    with pytest.raises(UsageError, match="uses both tf and torch.*Add --framework torch"):
        shell.run_cell_magic("distrain", "", "import torch, tensorflow\n")
    assert magics.cluster.running == running


def test_check_only_and_check_subcommand(shell, magics, capsys):
    running = magics.cluster.running
    shell.run_cell_magic("distrain", "--check-only", "dist.init_process_group('nccl')\n")
    out = capsys.readouterr().out
    assert "nbdist check [nccl-without-gpu] cell line 1:" in out
    shell.user_ns["snippet"] = "model = nn.DataParallel(net)\nmodel = DDP(model)\n"
    shell.run_line_magic("distrain", "check snippet")
    assert "nbdist check [dataparallel-in-ddp] cell line 1:" in capsys.readouterr().out
    shell.run_line_magic("distrain", "check x = 1")
    assert capsys.readouterr().out == "nbdist check: no distributed-training mistakes found\n"
    assert magics.cluster.running == running
