"""On a GPU machine, workers started at ``%load_ext nbdist`` touch no CUDA before the first cell:
no context in their processes and no GPU memory taken, though torch is already imported there.
The first cell then runs on each worker's own GPU."""

from __future__ import annotations

import subprocess

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ipyparallel")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.cluster,
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# A CUDA context alone takes a few hundred MiB on current GPUs; an engine that made one would
# show far more than this, whatever else runs on the machine meanwhile.
CONTEXT_MIB = 100


def _smi(query: str) -> list[str]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def _used_mib() -> list[int]:
    return [int(v) for v in _smi("gpu=memory.used")]


def _compute_pids() -> set[int]:
    return {int(v) for v in _smi("compute-apps=pid") if v.isdigit()}


def test_prestarted_engines_touch_no_cuda_until_the_first_cell(shell, monkeypatch):
    from nbdist.kernel.magic import PRESTART_ENV, DistrainMagics

    monkeypatch.setenv(PRESTART_ENV, "1")
    before = _used_mib()
    magics = DistrainMagics(shell)
    try:
        assert magics.start_in_background()
        assert magics.cluster.running  # waits for the background start
        cluster = magics.cluster
        probe = (
            "(__import__('sys').modules.get('torch') is not None, "
            "__import__('sys').modules['torch'].cuda.is_initialized())"
        )
        states = [cluster.apply_async(e.rank, eval, probe).get(60) for e in cluster.engines]
        assert states == [(True, False)] * cluster.size  # torch imported, CUDA untouched
        assert not {e.pid for e in cluster.engines} & _compute_pids()
        grew = [after - b for after, b in zip(_used_mib(), before, strict=True)]
        assert all(g < CONTEXT_MIB for g in grew), f"GPU memory grew by {grew} MiB"

        magics.distrain("-o res", "(torch.cuda.is_initialized(), str(device))\n")
        assert shell.user_ns["res"].values == [(True, f"cuda:{r}") for r in range(cluster.size)]
    finally:
        magics.close()
