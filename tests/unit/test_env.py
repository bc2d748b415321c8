import os
import subprocess
import sys

import pytest

from nbdist.engine.env import patch_environment


def test_restores_after_success(monkeypatch):
    monkeypatch.setenv("NBDIST_T_OLD", "old")
    monkeypatch.delenv("NBDIST_T_NEW", raising=False)
    with patch_environment({"NBDIST_T_OLD": "1", "NBDIST_T_NEW": "2"}):
        assert (os.environ["NBDIST_T_OLD"], os.environ["NBDIST_T_NEW"]) == ("1", "2")
    assert os.environ["NBDIST_T_OLD"] == "old"
    assert "NBDIST_T_NEW" not in os.environ


def test_restores_after_error(monkeypatch):
    monkeypatch.delenv("NBDIST_T_NEW", raising=False)
    with pytest.raises(KeyError), patch_environment({"NBDIST_T_NEW": "2"}):
        raise KeyError("x")
    assert "NBDIST_T_NEW" not in os.environ


# A subprocess each: a KeyboardInterrupt gone astray must not end this test session.
KEPT = """
import os, signal, sys, threading, time
from nbdist.engine.env import interrupts_kept

class Slow:
    def __del__(self):
        time.sleep(1.0)  # the interrupt lands here, in a finalizer

threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.monotonic()
try:
    with {context}:
        while time.monotonic() - start < 4:
            Slow()
            time.sleep(0.01)
    print("ran on")
except KeyboardInterrupt:
    print("stopped after", time.monotonic() - start)
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )


def test_an_interrupt_a_finalizer_took_still_stops_the_block():
    kept = _run(KEPT.format(context="interrupts_kept()"))
    word, after, seconds = kept.stdout.split()
    assert (word, after) == ("stopped", "after")
    assert 0.3 <= float(seconds) < 1.0  # the interrupt at 0.3 s, the finalizer would take 1 s
    assert kept.stderr == ""  # not printed as "Exception ignored in ..." either
    plain = _run(KEPT.format(context="__import__('contextlib').nullcontext()"))
    assert plain.stdout == "ran on\n"  # what Python does: the interrupt is lost
    assert "Exception ignored in: <function Slow.__del__" in plain.stderr


def test_an_interrupt_still_on_its_way_when_the_block_ends_is_raised_there():
    code = """
import time
from nbdist.engine.env import interrupts_kept

class Raises:
    def __del__(self):
        raise KeyboardInterrupt  # as an interrupt in a finalizer, just before the block ends

try:
    with interrupts_kept():
        Raises()
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted")
time.sleep(0.1)  # nothing more arrives after the block
print("then quiet")
"""
    assert _run(code).stdout == "interrupted\nthen quiet\n"
