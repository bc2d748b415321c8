from __future__ import annotations

import os
import signal

import psutil
import pytest

PRESTART_ENV = "NBDIST_PRESTART"


def pytest_configure(config: pytest.Config) -> None:
    """The suite's kernels (nbval's, the browser test's) and shells start their workers when a
    test asks, as before prestart existed: tests that measure or expect a start keep seeing it
    where they ask for it. tests/integration/test_prestart.py turns it on where it is the
    subject. Set for the run (before nbval starts a kernel), put back after it; importing this
    file changes nothing.

    And SIGINT interrupts, however the suite was started: a suite started with ``&`` from a
    script (or under nohup) inherits SIGINT ignored, Python then installs no handler, and the
    engines it starts inherit it ignored too (14 tests of the interrupt lost their "the SIGINT
    did not arrive"). The handler a terminal's Python has is put in place for the run."""
    config.stash[_SAVED] = os.environ.get(PRESTART_ENV)
    os.environ[PRESTART_ENV] = "0"
    config.stash[_SIGINT] = signal.getsignal(signal.SIGINT)
    if config.stash[_SIGINT] is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    handler = config.stash.get(_SIGINT, None)
    if handler is signal.SIG_IGN:
        signal.signal(signal.SIGINT, handler)
    saved = config.stash.get(_SAVED, None)
    if saved is None:
        os.environ.pop(PRESTART_ENV, None)
    else:
        os.environ[PRESTART_ENV] = saved


_SAVED = pytest.StashKey[str | None]()
_SIGINT = pytest.StashKey[object]()


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
