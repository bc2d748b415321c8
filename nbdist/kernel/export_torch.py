"""torch's part of ``%distrain export``'s script (see :mod:`nbdist.kernel.export`): the
process group set up as nbdist did, the command that runs it (``torchrun``, on one machine,
several, or in a Slurm job), and the group left after the cells as nbdist leaves it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbdist.kernel.export import CellRecord, Script

_SETUP = """
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

# torchrun runs the ranks unbuffered (PYTHONUNBUFFERED=1): print() then writes each of its
# pieces on its own, and two ranks' lines ran into each other ("freshfresh  44 ..."). One
# write per line:
sys.stdout.reconfigure(line_buffering=True, write_through=False)
sys.stderr.reconfigure(line_buffering=True, write_through=False)

# torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
# init_process_group("...") with no init_method reads them (the env:// rendezvous).
local_rank = int(os.environ["LOCAL_RANK"])
local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
# As nbdist did: each process uses the GPU of its local rank; with fewer GPUs than processes on
# a machine, every process uses the CPU (with nccl each needs a GPU of its own).
if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    backend = "nccl"
else:
    device = torch.device("cpu")
    backend = "gloo"
    # Processes on one machine share its cores: split them, as nbdist did.
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, _cores // local_world_size))
"""

_INIT = """
dist.init_process_group({backend})
rank = dist.get_rank()
world_size = dist.get_world_size()
is_main = rank == 0
"""

_TEARDOWN = """\
# Leave the group as nbdist does: first what holds on to it (a DDP model's reducer, the
# optimizers), then the group. Destroyed under a live DDP model, gloo can deadlock
# (pytorch#56297); never destroyed, a process can abort as it exits ("terminate called
# without an active exception").
import gc as _gc

import torch as _torch
import torch.distributed as _dist
from torch.nn.parallel import DistributedDataParallel as _DDP

for _name in [
    name
    for name, value in globals().items()
    if isinstance(value, (_DDP, _torch.optim.Optimizer))
]:
    del globals()[_name]
_gc.collect()
# type(), not isinstance(): a dead weakref.proxy among the objects raises on isinstance.
if _dist.is_initialized() and not any(issubclass(type(o), _DDP) for o in _gc.get_objects()):
    _dist.destroy_process_group()  # else a DDP model is still held: exit frees it
"""

_OWN_INIT = """
# The cell calls init_process_group itself; rank and world_size come from torchrun's environment.
rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
is_main = rank == 0
"""

_AUTOLOG = """

# nbdist recorded the loss of every backward() with no code in the cell ("autolog"); the cell
# has no log(...) call, so here is the same capture spelled out: each scalar loss that
# .backward() is called on is logged.
_backward = torch.Tensor.backward


def _logged_backward(self, *args, **kwargs):
    if self.numel() == 1:
        log(loss=self.detach())
    return _backward(self, *args, **kwargs)


torch.Tensor.backward = _logged_backward
"""

_INTERFACES_SET = """
# The interface each machine reached the others on in the session, by its hostname: gloo's own
# guess (the address the hostname resolves to) fails where names do not resolve, or picks
# 127.0.1.1. GLOO_SOCKET_IFNAME set before the run wins.
import socket

_INTERFACES = {table}
if socket.gethostname() in _INTERFACES:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _INTERFACES[socket.gethostname()])
"""


def _interface_table(nodes: Sequence[tuple[str, str, str | None, int]]) -> str:
    return repr({host: iface for host, _, iface, _ in nodes if iface})


def multi_node_commands(nodes: Sequence[tuple[str, str, str | None, int]], script: str) -> str:
    """The header's part for a session that ran on several machines: the torchrun command
    for each, with the rendezvous on rank 0's machine and its address (no name to resolve)."""
    _, master, _, _ = nodes[0]
    per_node = {workers for *_, workers in nodes}
    lines = [
        f"It ran on {len(nodes)} machines. Start it on each, the same rendezvous on rank 0's "
        "machine (a static one: the same ranks on the same machines as in the session):",
        "",
    ]
    for i, (host, address, iface, workers) in enumerate(nodes):
        env = f"GLOO_SOCKET_IFNAME={iface} " if iface else ""
        lines.append(f"    # on {host} ({address})")
        lines.append(
            f"    {env}torchrun --nnodes {len(nodes)} --nproc_per_node {workers} --node_rank {i} "
            f"--master_addr {master} --master_port 29400 {script}"
        )
    if len(per_node) > 1:
        lines.append(
            "\n(torchrun starts the same number of processes on every machine: these ran "
            f"{' and '.join(str(w) for *_, w in nodes)}; make them equal.)"
        )
    return "\n".join(lines) + "\n"


# The first node of the job, by the address Slurm reaches it at (NodeAddr: a node's name need
# not resolve); run inside the job, on any of its nodes.
_FIRST_NODE = (
    'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
    '    export MASTER_ADDR=$(scontrol show node "$first" | '
    "sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')"
)


def slurm_commands(nodes: Sequence[tuple[str, str, str | None, int]], script: str, job: str) -> str:
    """The header's part for a session that ran in a Slurm job: a batch script to give
    ``sbatch``, whose last lines are the ``srun`` + ``torchrun`` command for an allocation the
    user holds (``salloc``). One torchrun per node (``--ntasks-per-node=1``), each starting that
    node's workers; the rendezvous on the job's first node."""
    workers = max(w for *_, w in nodes)
    n = len(nodes)
    torchrun = (
        f"torchrun --nnodes {n} --nproc_per_node {workers} --node_rank $SLURM_NODEID "
        f"--master_addr $MASTER_ADDR --master_port 29400 {script}"
    )
    return (
        f"It ran in Slurm job {job}, on {n} node{'s' if n > 1 else ''} with {workers} "
        f"worker{'s' if workers > 1 else ''} each. To run it as a batch job, save these lines "
        f"as {Path(script).stem}.sbatch beside it and run sbatch {Path(script).stem}.sbatch "
        "there:\n\n"
        "    #!/bin/sh\n"
        f"    #SBATCH --nodes={n}\n"
        "    #SBATCH --ntasks-per-node=1\n"
        f"    #SBATCH --cpus-per-task={workers}\n"
        f"    {_FIRST_NODE}\n"
        f"    srun sh -c '{torchrun}'\n\n"
        f"In an allocation you hold (salloc --nodes={n} --ntasks-per-node=1 "
        f"--cpus-per-task={workers}), the last two lines are the command.\n"
    )


def script(ran: Sequence[CellRecord], used: set[str], path: Path) -> Script:
    """The set-up before the cells (its ``log`` goes between ``setup`` and ``after_log``), how
    to run the script, and what follows the cells."""
    from nbdist.kernel.export import Script

    last = ran[-1]
    setup = [_SETUP]
    if len(last.nodes) > 1:
        setup.append(_INTERFACES_SET.format(table=_interface_table(last.nodes)))
    if "init_process_group" in used:
        setup.append(_OWN_INIT)
    else:
        chosen = repr(last.backend) if last.backend else "backend"
        setup.append(_INIT.format(backend=chosen))
    after_log = [_AUTOLOG] if any(c.autolog for c in ran) and "log" not in used else []
    how = f"Run it with:\n\n    torchrun --nproc_per_node {last.world_size} {path.name}\n"
    if last.slurm_job is not None:
        how = slurm_commands(last.nodes, path.name, last.slurm_job)
    elif len(last.nodes) > 1:
        how = multi_node_commands(last.nodes, path.name)
    after = "" if "destroy_process_group" in used else _TEARDOWN
    return Script(setup=setup, how=how, after_log=after_log, after_cells=after)
