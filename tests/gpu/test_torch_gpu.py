"""%%distrain on real local engines, one per visible GPU, with real torch.distributed (nccl).

The tests share one cluster and run in file order: the first looks at the engines before any
cell has started CUDA on them. Run with ``pytest -m gpu`` where there are GPUs (skipped, with the
reason, elsewhere: see ``conftest.py``).
"""

from __future__ import annotations

import re
import textwrap
import time

import pytest
from IPython.core.error import UsageError

from nbdist import JobStalled, WorkerError
from nbdist.engine import session_ops

pytestmark = [pytest.mark.gpu, pytest.mark.cluster, pytest.mark.torch]

CELL_LIMIT = "--timeout 120"  # a hung collective is a JobTimeout, not a test run without end
MiB = 2**20

# On each engine, outside any cell: its CUDA_VISIBLE_DEVICES, whether torch is imported, and
# what the CUDA driver answers to a device count. CUDA_ERROR_NOT_INITIALIZED (3) means nothing in
# the process has called cuInit yet, so the CUDA_VISIBLE_DEVICES nbdist set is what CUDA will
# read. Loading libcuda to ask does not initialise it.
PROBE = textwrap.dedent(
    """
    import ctypes, os, sys
    count = ctypes.c_int()
    code = ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count))
    result = (os.environ.get("CUDA_VISIBLE_DEVICES"), "torch" in sys.modules, code)
    """
)
CUDA_ERROR_NOT_INITIALIZED = 3

TRAIN = textwrap.dedent(
    """
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4096, 64, generator=g)
    Y = X @ torch.randn(64, 8, generator=g) / 8
    xs, ys = X[rank::world_size].to(device), Y[rank::world_size].to(device)
    torch.manual_seed(rank)  # different initial weights on each rank: DDP makes them equal
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        i = (step * 128) % (xs.shape[0] - 128)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xs[i : i + 128]), ys[i : i + 128])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    (losses[0], losses[-1], next(model.parameters()).device.type,
     [p.detach().cpu() for p in model.parameters()])
    """
)

FSDP2 = textwrap.dedent(
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (world_size,))
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4096, 64, generator=g)
    Y = X @ torch.randn(64, 8, generator=g) / 8
    xs, ys = X[rank::world_size].to(device), Y[rank::world_size].to(device)
    torch.manual_seed(0)
    sharded = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt = torch.optim.Adam(sharded.parameters(), lr=1e-3)
    losses = []
    for step in range(200):
        i = (step * 128) % (xs.shape[0] - 128)
        opt.zero_grad()
        loss = nn.functional.mse_loss(sharded(xs[i : i + 128]), ys[i : i + 128])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    weight = sharded[0].weight
    (losses[0], losses[-1], type(weight).__name__, weight.device.type,
     [p.full_tensor().cpu() for p in sharded.parameters()])
    """
)


def train_cell(steps=200):
    return TRAIN.replace("STEPS", str(steps))


def on_engines(cluster, source):
    """Run ``source`` (which sets ``result``) on every engine outside any cell; rank order."""
    expr = f"(lambda ns: (exec({source!r}, ns), ns['result'])[1])({{}})"
    return [cluster.apply_async(e.rank, eval, expr).get(60) for e in cluster.engines]


def engine_memory(cluster):
    """``session_ops.memory()`` of every rank (its ``gpu``: torch.cuda.memory_allocated)."""
    return [cluster.apply_async(e.rank, session_ops.memory).get(60) for e in cluster.engines]


def settled_gpu_memory(cluster):
    """Each rank's torch.cuda.memory_allocated once it stops changing. nccl's watchdog thread
    holds the buffers of finished collectives until it next wakes (every ~0.1 s): two equal
    readings 0.3 s apart mean it has let go of them."""
    last = None
    for _ in range(40):
        now = [m.gpu for m in engine_memory(cluster)]
        if now == last:
            return now
        last = now
        time.sleep(0.3)
    raise AssertionError(f"GPU memory still changing after 12 s: {last}")


@pytest.fixture(scope="module")
def magics(shell):
    return shell.magics_manager.registry["DistrainMagics"]


@pytest.fixture(scope="module")
def on_gpus(shell, magics, gpus):
    """A fresh cluster with one worker per visible GPU, its engines importing torch as they
    start (as for a first %%distrain cell), before nbdist gives each its GPUs."""
    shell.run_line_magic("distrain", "stop")  # whatever another module left running
    magics.cluster.preload = "torch"
    shell.run_line_magic("distrain", f"start -n {len(gpus)}")
    yield shell
    shell.run_line_magic("distrain", "stop")


def test_each_engine_sees_the_gpus_before_cuda_starts(on_gpus, magics, gpus):
    assert [e.gpu for e in magics.cluster.engines] == gpus
    visible = ",".join(gpus)
    assert on_engines(magics.cluster, PROBE) == [
        (visible, True, CUDA_ERROR_NOT_INITIALIZED) for _ in gpus
    ]


def test_nccl_is_the_default_and_each_rank_has_cuda_of_its_local_rank(on_gpus, gpus):
    cell = textwrap.dedent(
        """
        import os
        t = torch.ones(1, device=device) * (rank + 1)
        dist.all_reduce(t)
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        (dist.get_backend(), str(device), torch.cuda.device_count(), torch.cuda.current_device(),
         os.environ["CUDA_VISIBLE_DEVICES"], t.item(), uuid)
        """
    )
    on_gpus.run_cell_magic("distrain", f"-o res {CELL_LIMIT}", cell)
    values = on_gpus.user_ns["res"].values
    n = len(gpus)
    # As under torchrun: every rank sees the GPUs, and uses the one of its local rank.
    assert [v[:6] for v in values] == [
        ("nccl", f"cuda:{r}", n, r, ",".join(gpus), n * (n + 1) / 2) for r in range(n)
    ]
    assert len({v[6] for v in values}) == n  # n different physical GPUs


def test_ddp_mlp_trains_on_the_gpus_with_parameters_equal_across_ranks(on_gpus, gpus):
    on_gpus.run_cell_magic("distrain", f"-o res {CELL_LIMIT}", train_cell())
    values = on_gpus.user_ns["res"].values
    assert len(values) == len(gpus)
    for first, last, device_type, _ in values:
        assert device_type == "cuda"
        assert last < 0.5 * first
    params0 = values[0][3]
    assert len(params0) == 4
    for _, _, _, params in values[1:]:
        for a, b in zip(params0, params, strict=True):
            assert a.equal(b)


def test_fsdp2_trains_on_the_gpus(on_gpus, gpus):
    on_gpus.run_cell_magic("distrain", f"-o res {CELL_LIMIT}", FSDP2)
    values = on_gpus.user_ns["res"].values
    assert len(values) == len(gpus)
    for first, last, kind, device_type, _ in values:
        assert (kind, device_type) == ("DTensor", "cuda")
        assert last < 0.5 * first
    for _, _, _, _, params in values[1:]:
        for a, b in zip(values[0][4], params, strict=True):
            assert a.equal(b)


def test_status_names_each_gpu_and_the_memory_in_use(on_gpus, magics, gpus, capsys):
    cell = "held = torch.ones(64 * 2**20 // 4, device=device)\ntorch.cuda.get_device_name(device)\n"
    on_gpus.run_cell_magic("distrain", f"-o res {CELL_LIMIT}", cell)
    names = on_gpus.user_ns["res"].values
    capsys.readouterr()
    on_gpus.run_line_magic("distrain", "status")
    out = capsys.readouterr().out
    lines = out.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("rank     memory  gpu memory")]
    assert len(heads) == 1, out
    head = heads[0]
    assert lines[head].endswith("variables  gpu"), out
    rows = lines[head + 1 : head + 1 + len(gpus)]
    for rank, (row, gpu, name) in enumerate(zip(rows, gpus, names, strict=True)):
        m = re.fullmatch(
            rf"\s*{rank}\s+\d+ MB\s+(\d+) MB\s+\d+\s+{re.escape(gpu)}: {re.escape(name)}, "
            r"([\d,]+) of ([\d,]+) MiB in use",
            row,
        )
        assert m, f"status row for rank {rank}: {row!r}\n{out}"
        held_mb, used, total = int(m[1]), int(m[2].replace(",", "")), int(m[3].replace(",", ""))
        assert held_mb >= 64  # this rank's tensors, torch's count
        assert 64 <= used <= total  # the whole GPU, nvidia-smi's count
    # The hosts line names the GPUs the workers use.
    assert f"GPUs {','.join(gpus)}" in out


def test_reset_gives_the_gpu_memory_back(on_gpus, magics):
    cluster = magics.cluster
    # Baseline after one training cell and a reset: what a rank keeps for good (cuBLAS's
    # workspace, taken at the first matmul) is in it.
    on_gpus.run_cell_magic("distrain", CELL_LIMIT, train_cell(steps=20))
    on_gpus.run_line_magic("distrain", "reset")
    base = settled_gpu_memory(cluster)
    reserved = "import torch\nresult = torch.cuda.memory_reserved()\n"
    base_reserved = on_engines(cluster, reserved)

    cell = "big = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)\n" + train_cell(20)
    on_gpus.run_cell_magic("distrain", CELL_LIMIT, cell)
    during = [m.gpu for m in engine_memory(cluster)]
    assert all(d >= b + 512 * MiB for d, b in zip(during, base, strict=True))

    on_gpus.run_line_magic("distrain", "reset")
    assert settled_gpu_memory(cluster) == base
    # And the cache hands it back to the device: nvidia-smi sees it free again.
    after_reserved = on_engines(cluster, reserved)
    assert all(a < b + 512 * MiB for a, b in zip(after_reserved, base_reserved, strict=True))


def test_more_workers_than_gpus_run_on_the_cpu_and_nccl_is_refused(on_gpus, magics, gpus, capsys):
    n = len(gpus)
    capsys.readouterr()
    on_gpus.run_cell_magic("distrain", f"-n {n + 1} -o res", "(str(device), dist.get_backend())")
    assert on_gpus.user_ns["res"].values == [("cpu", "gloo")] * (n + 1)
    assert "the workers use the CPU (gloo), since with nccl each needs a GPU of its own" in (
        capsys.readouterr().out
    )
    with pytest.raises(UsageError, match="--backend nccl needs GPUs and this cluster has none"):
        on_gpus.run_cell_magic("distrain", f"-n {n + 1} --backend nccl", "x = 1\n")
    on_gpus.run_cell_magic("distrain", f"-n {n} -o res", "str(device)")
    assert on_gpus.user_ns["res"].values == [f"cuda:{r}" for r in range(n)]


def test_gloo_on_gpu_engines(on_gpus, gpus):
    cell = textwrap.dedent(
        """
        import os
        t = torch.ones(1) * (rank + 1)
        dist.all_reduce(t)
        c = torch.ones(1, device=f"cuda:{local_rank}") * (rank + 1)  # gloo reduces CUDA too
        dist.all_reduce(c)
        (dist.get_backend(), str(device), t.item(), c.item(), torch.cuda.device_count(),
         os.environ["CUDA_VISIBLE_DEVICES"])
        """
    )
    on_gpus.run_cell_magic("distrain", f"--backend gloo -o res {CELL_LIMIT}", cell)
    n = len(gpus)
    total = n * (n + 1) / 2
    visible = ",".join(gpus)
    assert on_gpus.user_ns["res"].values == [("gloo", "cpu", total, total, n, visible)] * n


def test_a_rank_that_raises_is_reported_and_the_next_gpu_cell_works(on_gpus, gpus):
    n = len(gpus)
    cell = textwrap.dedent(
        """
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        if rank == world_size - 1:
            raise ValueError(f"bad batch on rank {rank}")
        t.item()
        """
    )
    with pytest.raises(WorkerError) as info:
        on_gpus.run_cell_magic("distrain", CELL_LIMIT, cell)
    assert info.value.ranks == [n - 1]
    assert f"raised ValueError: bad batch on rank {n - 1}" in str(info.value)
    after = "t = torch.ones(1, device=device)\ndist.all_reduce(t)\n(dist.get_backend(), t.item())\n"
    on_gpus.run_cell_magic("distrain", f"-o res {CELL_LIMIT}", after)
    assert on_gpus.user_ns["res"].values == [("nccl", float(n))] * n


def test_profile_on_cuda_measures_kernels_and_nccl(on_gpus, gpus, tmp_path, monkeypatch):
    """--profile on GPUs: computation is the CUDA kernels, communication NCCL's kernels; the
    parts add up to the step, and each rank's trace holds its kernels."""
    from nbdist.kernel.breakdown import PARTS, trace_events

    monkeypatch.chdir(tmp_path)
    on_gpus.run_cell_magic("distrain", f"--profile 3 --no-plot -o res {CELL_LIMIT}", train_cell(20))
    profile = on_gpus.user_ns["res"].profile
    assert profile is not None and profile.device == "cuda"
    assert [r.rank for r in profile.ranks] == list(range(len(gpus)))
    for r in profile.ranks:
        assert r.steps == 3 and r.compute_ms > 0
        parts = sum(getattr(r, f"{p}_ms") for p in PARTS)
        assert abs(parts - r.step_ms) <= 0.05 * r.step_ms
        names = {e.get("name", "") for e in trace_events(r.trace)}
        if len(gpus) > 1:
            assert any("nccl" in n.lower() for n in names), sorted(names)[:20]
            assert r.communication_ms + r.overlapped_ms + r.waiting_ms > 0


def test_a_stall_on_nccl_says_what_the_flight_recorder_saw(on_gpus, gpus):
    """The last rank sleeps before its 6th all-reduce; the others wait in it. The stall's
    report reads each rank's last collective from torch's flight recorder, numbered: the
    sleeping rank is one behind."""
    n = len(gpus)
    if n < 2:
        pytest.skip(f"a stall needs two ranks, and this machine has {n} GPU")
    cell = textwrap.dedent(
        """
        import time
        t = torch.ones(1, device=device)
        for step in range(20):
            if rank == world_size - 1 and step == 5:
                time.sleep(3600)
            dist.all_reduce(t)
            torch.cuda.synchronize()
            log(loss=1.0)
        """
    )
    with pytest.raises(JobStalled) as info:
        on_gpus.run_cell_magic("distrain", f"--stall 5 {CELL_LIMIT}", cell)
    flight = info.value.flight
    said = re.fullmatch(
        r"torch's flight recorder, each rank's last collective: (.*) \((.*)\)\.", flight
    )
    assert said, flight
    ranks = dict(re.findall(r"rank (\d+) #(\d+) nccl:all_reduce", said.group(1)))
    assert len(ranks) == n, flight
    last = ranks.pop(str(n - 1))
    assert all(int(seq) == int(last) + 1 for seq in ranks.values()), flight
    assert said.group(2) == f"rank {n - 1} is 1 collective behind", flight
    assert flight in "\n".join(info.value._render_traceback_())
