"""What a cell shows from a worker (nbdist.engine.display): which values come back."""

from __future__ import annotations

import sys
import threading
import types

from nbdist.engine.display import packed


def test_plain_values_come_back_and_what_would_import_a_framework_does_not(monkeypatch):
    assert packed(3).unpack() == 3
    assert packed({"loss": [0.5, 0.25]}).unpack() == {"loss": [0.5, 0.25]}
    assert packed(None).unpack() is None
    assert packed(threading.Lock()) is None  # cannot be pickled: its repr is shown
    # A value whose class lives in a framework the notebook does not import (here a stand-in
    # "jax"; Keras' History is the case seen): unpickled there, it would import it.
    fake = types.ModuleType("jax")

    class Array:
        pass

    Array.__module__, Array.__qualname__ = "jax", "Array"
    fake.Array = Array
    monkeypatch.setitem(sys.modules, "jax", fake)
    assert packed(Array()) is None
    assert packed([1, {"x": Array()}]) is None  # however deep


def test_a_value_of_a_class_defined_in_a_cell_comes_back_by_value():
    """A cell's ``class Point`` lives in the engine's ``__main__``, which the notebook does
    not have: it travels with the value."""
    namespace = {"__name__": "__main__"}
    exec("class Point:\n    def __init__(self, x):\n        self.x = x\n", namespace)
    value = packed([namespace["Point"](3)])
    namespace.clear()  # the class is gone from this side too: only the bytes hold it
    (point,) = value.unpack()
    assert (type(point).__name__, point.x) == ("Point", 3)
