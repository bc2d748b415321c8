"""Choosing a cell's framework before anything runs."""

from __future__ import annotations

import importlib.util

import pytest
from IPython.core.error import UsageError

from nbdist.kernel import prepare
from nbdist.kernel.options import RunOptions
from nbdist.kernel.source import parse_cell


def test_framework_from_the_cell_then_the_workers_then_what_is_installed():
    choose = prepare.choose_framework
    assert choose(parse_cell("import tensorflow as tf\n"), RunOptions(), "torch") == "tf"
    assert choose(parse_cell("x = 1\n"), RunOptions(), "tf") == "tf"
    assert choose(parse_cell("x = 1\n"), RunOptions(), None) == "torch"


def test_neither_framework_installed(monkeypatch):
    real = importlib.util.find_spec
    missing = {"torch", "tensorflow"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name in missing else real(name)
    )
    with pytest.raises(
        UsageError,
        match="neither torch nor tensorflow is installed in this kernel's environment; "
        "pip install torch",
    ):
        prepare.choose_framework(parse_cell("x = 1\n"), RunOptions(), None)
