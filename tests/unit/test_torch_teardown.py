"""The torch backend's teardown lets the process group go, so its gloo sockets close (that is
what frees a peer blocked in a collective), also after DTensor/FSDP2 used the group."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

# A one-rank gloo group in a fresh process (DTensor's caches live for the process): a DTensor
# redistribution leaves its DeviceMesh, which holds the group, in those caches. Whether the
# group's Python object outlives the destroy is what decides if its sockets close.
CODE = textwrap.dedent(
    """
    import gc, sys, weakref
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from nbdist.engine.backends import torch_ddp

    torch_ddp.preload()  # as on an engine

    def group_after(teardown):  # once a process: a second mesh would hit the caches
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)]).full_tensor()
        group = weakref.ref(dist.group.WORLD)
        teardown()
        gc.collect()
        return group() is not None

    if sys.argv[1] == "nbdist":
        print(group_after(lambda: torch_ddp._teardown({})))
    else:
        print(group_after(dist.destroy_process_group))
    """
)


def _group_alive_after(teardown: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CODE, teardown],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_teardown_lets_a_group_that_a_device_mesh_held_go():
    # torch's own destroy leaves the group alive (the mesh in DTensor's caches holds it) ...
    assert _group_alive_after("torch") == "True"
    # ... nbdist's teardown lets it go.
    assert _group_alive_after("nbdist") == "False"
