"""%distrain export: the last cell as a torchrun script that trains to the same parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

CELL = """
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
                                                          nn.Linear(16, 2)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
for step in range(20):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
if is_main:
    torch.save([p.detach() for p in model.parameters()], OUT)
"""


def test_export_before_any_run_says_what_to_do(shell, magics):
    magics.runner.last = None
    with pytest.raises(UsageError, match="no %%distrain cell has run in this kernel yet"):
        shell.run_line_magic("distrain", "export train.py")


def test_exported_script_trains_like_the_cell(shell, tmp_path, capsys):
    import torch

    shell.user_ns["OUT"] = str(tmp_path / "params.pt")
    shell.run_cell_magic("distrain", "-n 2 --framework torch --push OUT", CELL)
    in_notebook = torch.load(tmp_path / "params.pt")
    (tmp_path / "params.pt").unlink()

    script = tmp_path / "train.py"
    shell.run_line_magic("distrain", f"export {script}")
    assert f"wrote {script} (and train_push.pkl, the --push data)" in capsys.readouterr().out
    text = script.read_text()
    assert "torchrun --nproc_per_node 2 train.py" in text
    assert "dist.init_process_group(backend)" in text and CELL.strip() in text

    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    from_script = torch.load(tmp_path / "params.pt")
    assert len(from_script) == len(in_notebook) == 4
    for a, b in zip(from_script, in_notebook, strict=True):
        assert torch.equal(a, b)
    # nbdist's automatic loss capture, spelled out: one line per backward on each rank.
    assert "[rank 0] step 19 loss=" in run.stdout and "[rank 1] step 19 loss=" in run.stdout


def test_export_of_a_tf_cell_explains_tf_config(shell, tmp_path):
    from nbdist.kernel.export import LastCell, export_script

    last = LastCell(source="model.fit(x, y)\n", framework="tf", world_size=2, autolog=True)
    (script,) = export_script(last, tmp_path / "train_tf.py")
    text = script.read_text()
    assert (
        """TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]}, """
        """"task": {"type": "worker", "index": 1}}' python train_tf.py &"""
    ) in text
    assert "strategy = tf.distribute.MultiWorkerMirroredStrategy(" in text
    compile(text, str(script), "exec")


def test_export_keeps_the_backend_and_tells_log_from_torch_log(tmp_path):
    from nbdist.kernel.export import LastCell, export_script

    cell = "loss = torch.log(torch.ones(1)).sum()\nloss.backward()\n"
    last = LastCell(source=cell, framework="torch", world_size=2, autolog=True, backend="gloo")
    (script,) = export_script(last, tmp_path / "t.py")
    text = script.read_text()
    assert "dist.init_process_group('gloo')" in text
    assert "torch.Tensor.backward = _logged_backward" in text  # torch.log is not nbdist's log
    (script,) = export_script(
        LastCell(source="log(loss=1.0)\n", framework="torch", world_size=2, autolog=True),
        tmp_path / "u.py",
    )
    assert "_logged_backward" not in script.read_text()
    compile(text, "t.py", "exec")
