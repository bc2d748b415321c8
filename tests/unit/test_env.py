import os

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
