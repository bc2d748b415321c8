"""When ``%load_ext nbdist`` starts the workers in the background."""

from __future__ import annotations

import types

import pytest

from nbdist.kernel.magic import PRESTART_ENV, prestart_wanted

KERNEL = types.SimpleNamespace(kernel=object())  # a shell inside a Jupyter kernel
TERMINAL = types.SimpleNamespace(kernel=None)


@pytest.mark.parametrize(
    ("env", "shell", "configured", "wanted"),
    [
        (None, KERNEL, True, True),
        (None, KERNEL, False, False),
        (None, TERMINAL, True, False),
        ("0", KERNEL, True, False),
        ("off", KERNEL, True, False),
        ("1", TERMINAL, True, True),
        ("yes", KERNEL, False, True),
        ("", KERNEL, True, True),
    ],
)
def test_environment_then_trait_then_kernel(monkeypatch, env, shell, configured, wanted):
    if env is None:
        monkeypatch.delenv(PRESTART_ENV, raising=False)
    else:
        monkeypatch.setenv(PRESTART_ENV, env)
    assert prestart_wanted(shell, configured) is wanted


def test_the_suite_runs_without_prestart():
    import os

    assert os.environ[PRESTART_ENV] == "0"  # tests/conftest.py: tests that start workers ask


def test_trait_is_configurable(shell):
    from nbdist.kernel.magic import DistrainMagics

    magics = DistrainMagics(shell)
    assert magics.prestart is True
    shell.run_line_magic("config", "DistrainMagics.prestart = False")
    try:
        assert magics.prestart is False
        assert DistrainMagics(shell).prestart is False  # the shell's config, for new ones too
    finally:
        shell.run_line_magic("config", "DistrainMagics.prestart = True")
