"""The files ``%distrain export`` writes keep the user's umask, replaced (``--force``) or new."""

from __future__ import annotations

import os
import stat

import pytest

from nbdist.kernel.export import write_new


@pytest.mark.parametrize("replace", [False, True], ids=["new", "--force"])
def test_the_script_is_as_private_as_the_umask_asks(tmp_path, replace):
    path = tmp_path / "train.py"
    if replace:
        path.write_text("old\n")
    old = os.umask(0o077)
    try:
        write_new(path, b"print('x')\n", mode=0o644, replace=replace)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"print('x')\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # never world-readable under umask 077
    old = os.umask(0o022)
    try:
        write_new(path, b"print('y')\n", mode=0o644, replace=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
