"""%distrain export: the session's cells as one torchrun script that trains to the same
parameters; files are never replaced silently, and the pushed data is the user's alone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

BUILD = """
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
                                                          nn.Linear(16, 2)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=SCALE)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
"""
TRAIN = """
for step in range(STEPS):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
"""
CHECKSUM = "sum(float(p.detach().double().sum()) for p in model.parameters())"


def _session(shell, magics):
    shell.run_line_magic("distrain", "start -n 2")
    shell.run_line_magic("distrain", "reset")
    shell.user_ns["SCALE"] = 0.1
    shell.run_cell_magic("distrain", "-n 2 --framework torch --push SCALE", BUILD)
    shell.user_ns["STEPS"] = 10
    shell.run_line_magic("distrain", "push STEPS")
    shell.run_cell_magic("distrain", "", TRAIN)
    shell.run_cell_magic(
        "distrain", "--fresh --push SCALE", "z = world_size * 2\nprint('fresh', z, SCALE)\n"
    )
    with pytest.raises(Exception, match="boom"):  # a failed cell is left out of the export
        shell.run_cell_magic("distrain", "", "raise RuntimeError('boom')\n")
    shell.run_cell_magic("distrain", "", TRAIN)
    return shell.run_cell_magic("distrain", "", CHECKSUM)


def test_export_before_any_run_says_what_to_do(shell, magics):
    magics.session.cells = []
    with pytest.raises(UsageError, match="no %%distrain cell has run since the workers were"):
        shell.run_line_magic("distrain", "export train.py")


def test_three_cell_session_exported_trains_to_the_same_parameters(shell, magics, tmp_path, capsys):
    in_session = _session(shell, magics)
    assert isinstance(in_session, float)
    script = tmp_path / "train.py"
    shell.run_line_magic("distrain", f"export {script}")
    assert f"wrote {script} (and train_push.pkl, the --push data)" in capsys.readouterr().out
    text = script.read_text()
    assert "torchrun --nproc_per_node 2 train.py" in text
    assert "5 cells ran on 2 workers (torch)" in text
    assert text.count(TRAIN.strip()) == 2 and "boom" not in text
    assert "# --- %distrain push STEPS ---" in text
    assert "def _fresh_cell_3(SCALE):\n    z = world_size * 2" in text
    assert "_fresh_cell_3(**_pushed[3])" in text
    assert stat.S_IMODE(os.stat(tmp_path / "train_push.pkl").st_mode) == 0o600
    # The script leaves the group once the cells are done, the DDP model dropped first.
    after = "\n# --- after the cells "
    assert text.count(after) == 1 and text.rstrip().endswith(
        "_dist.destroy_process_group()  # else a DDP model is still held: exit frees it"
    )
    checksum = f"\nif is_main:\n    print('checksum', repr({CHECKSUM}))\n"
    script.write_text(text.replace(after, checksum + after))

    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "terminate called" not in run.stderr
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("checksum "))
    assert float(line.split()[1]) == in_session
    assert "fresh 4 0.1" in run.stdout
    # nbdist's automatic loss capture, spelled out: one line per backward on each rank.
    assert "[rank 0] step 19 loss=" in run.stdout and "[rank 1] step 19 loss=" in run.stdout

    # Never replaced silently; --force replaces both files.
    with pytest.raises(UsageError, match="already exist; choose another name or add --force"):
        shell.run_line_magic("distrain", f"export {script}")
    shell.run_line_magic("distrain", f"export {script} --force")
    assert "checksum" not in script.read_text()
    # The script refuses pushed data another user could have changed.
    os.chmod(tmp_path / "train_push.pkl", 0o620)
    bad = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert bad.returncode != 0 and "is writable by other users" in bad.stderr


def test_export_of_a_tf_cell_explains_tf_config(tmp_path):
    from nbdist.kernel.export import CellRecord, export_script

    cell = CellRecord(source="model.fit(x, y)\n", framework="tf", world_size=2, autolog=True)
    (script,) = export_script([cell], tmp_path / "train_tf.py")
    text = script.read_text()
    assert (
        """TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]}, """
        """"task": {"type": "worker", "index": 1}}' python train_tf.py &"""
    ) in text
    assert "strategy = tf.distribute.MultiWorkerMirroredStrategy(" in text
    compile(text, str(script), "exec")


def test_export_keeps_the_backend_and_tells_log_from_torch_log(tmp_path):
    from nbdist.kernel.export import CellRecord, ExportError, export_script

    cell = "loss = torch.log(torch.ones(1)).sum()\nloss.backward()\n"
    rec = CellRecord(source=cell, framework="torch", world_size=2, autolog=True, backend="gloo")
    (script,) = export_script([rec], tmp_path / "t.py")
    text = script.read_text()
    assert "dist.init_process_group('gloo')" in text
    assert "torch.Tensor.backward = _logged_backward" in text  # torch.log is not nbdist's log
    logged = CellRecord(source="log(loss=1.0)\n", framework="torch", world_size=2, autolog=True)
    (script,) = export_script([logged], tmp_path / "u.py")
    assert "_logged_backward" not in script.read_text()
    compile(text, "t.py", "exec")
    on = CellRecord(source="print(rank)\n", framework="torch", world_size=2, autolog=True, on=(0,))
    (script,) = export_script([on], tmp_path / "v.py")
    assert "if rank in (0,):\n    print(rank)" in script.read_text()
    tf = CellRecord(source="x = 1\n", framework="tf", world_size=2, autolog=True)
    with pytest.raises(ExportError, match="both torch and TensorFlow cells"):
        export_script([rec, tf], tmp_path / "w.py")


def test_export_of_a_session_on_machines_with_different_worker_counts(tmp_path):
    """Each machine's torchrun command; torchrun wants the same count everywhere: said so."""
    from nbdist.kernel.export import CellRecord, export_script

    nodes = (("n1", "10.0.0.1", "ib0", 4), ("n2", "10.0.0.2", None, 2))
    rec = CellRecord(source="x = 1\n", framework="torch", world_size=6, autolog=True, nodes=nodes)
    (script,) = export_script([rec], tmp_path / "t.py")
    text = script.read_text()
    assert (
        "    # on n1 (10.0.0.1)\n"
        "    GLOO_SOCKET_IFNAME=ib0 torchrun --nnodes 2 --nproc_per_node 4 --node_rank 0 "
        "--master_addr 10.0.0.1 --master_port 29400 t.py\n"
        "    # on n2 (10.0.0.2)\n"
        "    torchrun --nnodes 2 --nproc_per_node 2 --node_rank 1 --master_addr 10.0.0.1 "
        "--master_port 29400 t.py\n\n"
        "(torchrun starts the same number of processes on every machine: these ran 4 and 2; "
        "make them equal.)"
    ) in text
    assert "_INTERFACES = {'n1': 'ib0'}" in text
    compile(text, "t.py", "exec")
