"""The GPU tests skip, with a reason that says why, wherever CUDA cannot run them."""

from __future__ import annotations

import pytest

from nbdist.engine import hardware
from tests.gpu import conftest as gpu_conftest


@pytest.fixture
def reason(monkeypatch):
    """``no_cuda_reason`` computed afresh under this test's environment (it is cached)."""
    gpu_conftest.no_cuda_reason.cache_clear()
    yield lambda: (gpu_conftest.no_cuda_reason.cache_clear(), gpu_conftest.no_cuda_reason())[1]
    gpu_conftest.no_cuda_reason.cache_clear()


def test_no_gpu_visible(monkeypatch, reason):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert reason().startswith("no CUDA GPU visible (no nvidia-smi listing one, or ")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    assert reason().endswith("these tests run with `pytest -m gpu` on a machine with GPUs")


def test_gpus_visible_but_torch_cannot_use_them(monkeypatch, reason):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine's torch can use CUDA: the GPU tests run here")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert reason() == (
        f"GPUs are visible but torch {torch.__version__} cannot use CUDA (a CPU build?)"
    )
