"""Backends other packages register (``nbdist.backends`` entry points) come after nbdist's own
and cannot replace them."""

from __future__ import annotations

import sys

import pytest

from nbdist.engine import backends


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package installed on sys.path with the given entry points."""

    def install(points: dict[str, str]) -> None:
        info = tmp_path / "nbdist_extra-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nbdist-extra\nVersion: 1.0\n")
        lines = "".join(f"{name} = {module}\n" for name, module in points.items())
        (info / "entry_points.txt").write_text(f"[nbdist.backends]\n{lines}")
        monkeypatch.syspath_prepend(str(tmp_path))
        backends._registry.cache_clear()

    yield install
    backends._registry.cache_clear()


def test_a_registered_backend_comes_after_nbdists_own_which_it_cannot_replace(installed):
    installed({"jax": "nbdist_jax.backend", "torch": "somebody_elses.torch"})
    assert backends.frameworks() == ("torch", "tf", "jax")
    assert backends.load("torch").__name__ == "nbdist.engine.backends.torch_ddp"
    with pytest.raises(ModuleNotFoundError, match="nbdist_jax"):
        backends.load("jax")  # listed, and its package's module is what is imported


def test_an_unknown_framework_names_every_known_one():
    with pytest.raises(ValueError, match=r"unknown framework 'jax'; use one of: torch, tf$"):
        backends.load("jax")
    assert "nbdist_jax" not in sys.modules
