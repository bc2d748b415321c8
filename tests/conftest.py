from __future__ import annotations

import psutil
import pytest


def _ipyparallel_children() -> list[psutil.Process]:
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if any(k in cmd for k in ("ipyparallel", "ipengine", "ipcontroller", "nbdist.engine")):
            out.append(child)
    return out


@pytest.fixture(scope="session")
def shell():
    """An IPython shell with nbdist loaded; its cluster is stopped (and checked gone) at the end."""
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    yield ip
    ip.run_line_magic("unload_ext", "nbdist")
    gone, alive = psutil.wait_procs(_ipyparallel_children(), timeout=10)
    assert not alive, f"ipyparallel processes left behind: {[p.pid for p in alive]}"


@pytest.fixture
def magics(shell):
    return shell.magics_manager.registry["DistrainMagics"]
