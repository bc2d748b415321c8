import pytest
from IPython.core.error import UsageError

from nbdist.engine.hardware import visible_gpus


def test_docstring_teaches(shell):
    doc = shell.find_cell_magic("distrain").__doc__
    assert "%%distrain -n 2 -o result" in doc
    assert "--push" in doc and "--pull" in doc and "--timeout" in doc
    assert "%distrain status" in doc


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "",
            "%distrain needs a subcommand: start [-n N] [--network private|isolated|host] | "
            "stop | restart [-n N] [--network private|isolated|host] | status",
        ),
        ("launch", "invalid choice: 'launch'"),
        ("start -n 0", "needs at least 1 worker"),
    ],
)
def test_bad_subcommands(shell, line, expected):
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("distrain", line)
    assert expected in str(info.value)


def test_cell_errors_before_any_engine_starts(shell, stopped):
    magics, nothing_started = stopped

    def cell(line, source):
        return magics.distrain(line, source)

    with pytest.raises(UsageError, match=r"syntax error at Cell In\[\d+\], line 2"):
        cell("", "for\n")
    with pytest.raises(UsageError, match="the cell is empty"):
        cell("", "\n")
    with pytest.raises(UsageError, match="--push nothere: no variable 'nothere'"):
        cell("--push nothere", "import torch\n")
    shell.user_ns["gen"] = (i for i in range(3))
    with pytest.raises(UsageError, match="--push gen: a generator cannot be sent"):
        cell("--push gen", "import torch\n")
    with pytest.raises(UsageError, match="--backend is for torch cells; drop it for tf"):
        cell("--backend gloo", "import tensorflow\n")
    with pytest.raises(UsageError, match="--strategy is for TensorFlow cells"):
        cell("--strategy mirrored --framework torch", "x = 1\n")
    with pytest.raises(UsageError, match="uses both tf and torch.*Add --framework torch"):
        cell("", "import torch, tensorflow\n")
    with pytest.raises(UsageError, match="--ranks 2 does not exist; ranks go from 0 to 1"):
        cell("-n 2 --ranks 2", "x = 1\n")
    with pytest.raises(UsageError, match="--on 5 does not exist; ranks go from 0 to 1"):
        cell("--on 5", "x = 1\n")
    nothing_started()


@pytest.mark.skipif(bool(visible_gpus()), reason="this machine has GPUs: nccl is fine")
def test_nccl_without_gpus_on_a_stopped_cluster_starts_nothing(stopped):
    magics, nothing_started = stopped
    with pytest.raises(UsageError, match="--backend nccl needs GPUs and this cluster has none"):
        magics.distrain("--backend nccl", "x = 1\n")
    nothing_started()


def test_check_only_and_check_subcommand(shell, stopped, capsys):
    magics, nothing_started = stopped
    # A finding that holds on any machine (nccl-without-gpu does not fire where GPUs are).
    magics.distrain("--check-only", "mp.spawn(demo_basic, args=(2,), nprocs=2)\n")
    out = capsys.readouterr().out
    # The cell's line as the editor shows it, under the %%distrain line.
    assert f"nbdist check [spawn-in-cell] Cell In[{shell.execution_count}], line 2:" in out
    shell.user_ns["snippet"] = "model = nn.DataParallel(net)\nmodel = DDP(model)\n"
    magics.distrain("check snippet")
    assert "nbdist check [dataparallel-in-ddp] line 1:" in capsys.readouterr().out  # not a cell
    magics.distrain("check x = 1")
    assert capsys.readouterr().out == "nbdist check: no distributed-training mistakes found\n"
    nothing_started()


def test_a_line_that_cannot_be_split(stopped):
    magics, nothing_started = stopped
    with pytest.raises(UsageError, match='%distrain: cannot split "push \'a" \\(No closing'):
        magics.distrain("push 'a")
    nothing_started()


def test_tf_asked_onto_the_host_network_without_expose_tf_starts_nothing(stopped, monkeypatch):
    from nbdist.kernel.netns import MODE_ENV

    monkeypatch.setenv(MODE_ENV, "host")
    magics, nothing_started = stopped
    with pytest.raises(UsageError) as e:
        magics.distrain("--framework tf", "x = 1\n")
    assert str(e.value) == (
        "%%distrain: TensorFlow's MultiWorkerMirroredStrategy starts a gRPC server in each "
        "worker that accepts code from anybody, and here anyone who can reach this machine "
        "(NBDIST_ENGINE_NETWORK=host is set) could reach them. Use --strategy mirrored (one "
        "worker, no server), or add --expose-tf to run anyway."
    )
    nothing_started()
