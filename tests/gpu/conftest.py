"""Every test under ``tests/gpu/`` is marked ``gpu`` and needs CUDA: where there is none (CI, a
laptop), each is skipped with the reason, found without starting CUDA in this process and,
when no GPU is visible at all, without importing torch (the default ``pytest`` stays fast).

Run them where there are GPUs: ``pytest -m gpu`` (all visible GPUs become the workers).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from nbdist.engine.hardware import visible_gpus

HERE = Path(__file__).resolve().parent


@functools.cache
def no_cuda_reason() -> str | None:
    """Why the GPU tests cannot run here; None when they can."""
    if not visible_gpus():
        return (
            "no CUDA GPU visible (no nvidia-smi listing one, or CUDA_VISIBLE_DEVICES hides them "
            "all); these tests run with `pytest -m gpu` on a machine with GPUs"
        )
    try:
        import torch
    except ImportError:
        return "GPUs are visible but torch is not installed"
    # Counts devices (initialises the driver, creates no context: no GPU memory is taken).
    if not torch.cuda.is_available():
        return f"GPUs are visible but torch {torch.__version__} cannot use CUDA (a CPU build?)"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if HERE in Path(item.path).resolve().parents]
    if not ours:
        return
    reason = no_cuda_reason()
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpus() -> list[str]:
    """The GPUs this process sees (ids as ``CUDA_VISIBLE_DEVICES`` names them): one worker each."""
    return visible_gpus()
