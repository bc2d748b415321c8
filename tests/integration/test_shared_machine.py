"""Safe on a machine shared with another user (uid 4242, run as root to become it): the engines'
logs are private and go with the cluster, export never writes through a link someone planted,
and the exported script loads only a pickle of the user running it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from nbdist.kernel.export import CellRecord, export_script

pytestmark = [pytest.mark.cluster, pytest.mark.torch]

OTHER = 4242
AS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root (to be uid 4242 for a moment) and setpriv",
)


def _as_other(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *argv],
        capture_output=True, text=True, timeout=30, cwd="/",
    )  # fmt: skip


@AS_ROOT
def test_engine_output_is_private_and_goes_with_the_cluster(shell, magics, tmp_path):
    """A cell's raw output (here a token written to file descriptor 2, below Python) reaches
    the engine's log: 0600, in the cluster's own 0700 folders, not ~/.ipython's 0755 log
    folder, and gone with the cluster."""
    home_logs = Path.home() / ".ipython" / "profile_default" / "log"
    before = set(home_logs.iterdir()) if home_logs.is_dir() else set()
    shell.run_line_magic("distrain", "restart -n 2")
    cluster = magics.cluster
    profile = cluster._reaper.record.profile
    shell.run_cell_magic("distrain", "--no-plot", "import os\nos.write(2, b'hf_token=s3cr3t\\n')\n")
    logs = sorted((profile / "log").glob("ipengine-*.log"))
    assert len(logs) == 2
    assert any("hf_token=s3cr3t" in log.read_text() for log in logs)
    for path in (profile, profile / "log"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for log in logs:
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        refused = _as_other("cat", str(log))
        assert refused.returncode != 0 and "Permission denied" in refused.stderr
    assert (set(home_logs.iterdir()) if home_logs.is_dir() else set()) == before
    shell.run_line_magic("distrain", "stop")
    assert not profile.exists()


def test_every_message_is_signed_as_well_as_encrypted(shell, magics, caplog):
    """CurveZMQ on, and a signing key too: ipyparallel would drop the key with CurveZMQ, and
    the client and every engine then warned "Message signing is disabled. This is insecure".
    The key is in the private connection files, on no command line."""
    import json
    import logging

    import psutil

    with caplog.at_level(logging.WARNING):
        shell.run_line_magic("distrain", "restart -n 2")
        shell.run_cell_magic("distrain", "--no-plot", "x = rank\n")
    warned = [r.getMessage() for r in caplog.records if "signing is disabled" in r.getMessage()]
    assert warned == []
    cluster = magics.cluster
    security = cluster._reaper.record.profile / "security"
    keys = {json.loads(f.read_text())["key"] for f in security.glob("ipcontroller-*.json")}
    assert len(keys) == 1 and len(keys.pop()) == 64
    # The engines' log says they check signatures, and no process has the key on its command
    # line.
    logs = "".join(p.read_text() for p in (security.parent / "log").glob("ipengine-*.log"))
    assert "signing is disabled" not in logs
    key = json.loads(next(security.glob("ipcontroller-*-engine.json")).read_text())["key"]
    for proc in psutil.Process().children(recursive=True):
        try:
            assert key not in " ".join(proc.cmdline())
        except psutil.Error:
            continue


def test_export_never_writes_through_a_planted_link(shell, magics, tmp_path):
    """A dangling link in a shared folder, named like the script: export refuses it (it used to
    follow it and create the link's target, a startup file of the victim's); with --force the
    link itself is replaced, and its target still does not exist."""
    magics.session.cells = [
        CellRecord(source="x = 1\n", framework="torch", world_size=2, autolog=False)
    ]
    target = tmp_path / "startup" / "00-planted.py"
    target.parent.mkdir()
    script = tmp_path / "train.py"
    script.symlink_to(target)
    with pytest.raises(UsageError, match="already exists; choose another name or add --force"):
        shell.run_line_magic("distrain", f"export {script}")
    assert not target.exists()
    shell.run_line_magic("distrain", f"export {script} --force")
    assert not target.exists()
    assert not script.is_symlink() and "x = 1" in script.read_text()


def test_a_link_planted_between_the_check_and_the_write_is_not_followed(tmp_path, monkeypatch):
    """The race: nothing is there when export looks, a link is there when it writes."""
    from nbdist.kernel import export

    target = tmp_path / "elsewhere.py"
    script = tmp_path / "train.py"
    real_exists = os.path.lexists

    def plant(path):
        found = real_exists(path)
        if Path(path) == script and not found:
            script.symlink_to(target)  # just after the check
        return found

    monkeypatch.setattr(export.os.path, "lexists", plant)
    cell = CellRecord(source="x = 1\n", framework="torch", world_size=2, autolog=False)
    with pytest.raises(export.ExportError, match="already exists"):
        export_script([cell], script)
    assert not target.exists()


@AS_ROOT
def test_the_exported_script_loads_only_a_pickle_of_its_user(tmp_path):
    """An attacker's 0644 train_push.pkl beside a copy of train.py (a sticky shared folder:
    they may put files there, not change the user's): refused, as is a link to a pickle."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    cell = CellRecord(source="print('ran', n)\n", framework="torch", world_size=1,
                      autolog=False, push={"n": 1})  # fmt: skip
    script, data = export_script([cell], shared / "train.py")
    theirs = shared / "theirs.pkl"
    shutil.copy(data, theirs)
    os.chown(theirs, OTHER, OTHER)
    theirs.chmod(0o644)
    data.unlink()
    theirs.rename(data)

    def run():
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=60, cwd=shared)  # fmt: skip

    out = run()
    assert out.returncode != 0
    assert f"train_push.pkl belongs to uid {OTHER}, not to you" in out.stderr, out.stderr
    data.unlink()
    (shared / "real.pkl").write_bytes(b"")
    data.symlink_to(shared / "real.pkl")
    out = run()
    assert out.returncode != 0 and "it must be a file of yours, not a link" in out.stderr
