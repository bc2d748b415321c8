"""What a cell shows from a worker (nbdist.engine.display): which values come back."""

from __future__ import annotations

import sys
import threading
import types

from nbdist.engine.display import sendable


def test_plain_values_come_back_and_what_would_import_a_framework_does_not(monkeypatch):
    assert sendable(3) and sendable({"loss": [0.5, 0.25]}) and sendable(None)
    assert not sendable(threading.Lock())  # cannot be pickled: its repr is shown
    # A value whose class lives in a framework the notebook does not import (here a stand-in
    # "jax"; Keras' History is the case seen): unpickled there, it would import it.
    fake = types.ModuleType("jax")

    class Array:
        pass

    Array.__module__, Array.__qualname__ = "jax", "Array"
    fake.Array = Array
    monkeypatch.setitem(sys.modules, "jax", fake)
    assert not sendable(Array())
    assert not sendable([1, {"x": Array()}])  # however deep
