"""How a dead engine ended, read while ipyparallel's own watcher thread reaps it."""

from __future__ import annotations

import signal
import time

import psutil
from ipyparallel.cluster.launcher import LocalProcessLauncher

from nbdist.kernel.local import _ended


def _launched(tmp_path, command: list[str]) -> LocalProcessLauncher:
    launcher = LocalProcessLauncher(cmd_and_args=command, output_file=str(tmp_path / "out.log"))
    launcher.start()  # as ipyparallel starts an engine: a watcher thread waits for it
    return launcher


def _code_once_ended(launcher: LocalProcessLauncher) -> int | None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        code, ended = _ended(launcher)
        if ended:
            return code
        time.sleep(0.0001)
    raise AssertionError(f"pid {launcher.pid} never ended")


def test_a_killed_process_is_known_killed_every_time_while_the_watcher_reaps_it(tmp_path):
    # nbdist looks right after the kill, and keeps looking, as it does when a cell sees a rank
    # die: its look comes when ipyparallel's watcher wakes to reap the process. Two waits raced
    # there (psutil kept the loser's None): a CI run's status said "dead" without the cause.
    codes = []
    for _ in range(200):
        launcher = _launched(tmp_path, ["sleep", "60"])
        psutil.Process(launcher.pid).send_signal(signal.SIGKILL)
        codes.append(_code_once_ended(launcher))
        launcher._wait_thread.join(5)
    assert codes == [-signal.SIGKILL] * 200


def test_an_exit_code_and_a_running_process(tmp_path):
    launcher = _launched(tmp_path, ["sh", "-c", "sleep 0.5; exit 3"])
    assert _ended(launcher) == (None, False)
    assert _code_once_ended(launcher) == 3
    launcher._wait_thread.join(5)
    assert _ended(launcher) == (3, True)  # once reaped, the watcher's code
