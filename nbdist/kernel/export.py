"""``%distrain export train.py``: the session's ``%%distrain`` cells as one standalone script.

The script does explicitly what nbdist did around the cells: it sets up the process group (or
the TensorFlow strategy) once, defines the names the cells used (``rank``, ``world_size``,
``device``, ``strategy``, ``log``, ...) and prints metrics to stdout. The cells that ran since
the last reset or restart follow in order, verbatim (failed cells are left out; a ``--fresh``
cell becomes a function of its own, an ``--on`` cell an ``if rank in ...:`` block), so the
script trains exactly as the session did: run it with ``torchrun`` (PyTorch) or with one
``TF_CONFIG`` per worker process (TensorFlow).
"""

from __future__ import annotations

import ast
import contextlib
import os
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbdist.errors import ExportError
from nbdist.kernel.checks import calls
from nbdist.protocol import CellName, pack


@dataclass(frozen=True)
class CellRecord:
    """What ``export`` needs from one ``%%distrain`` cell that ran."""

    source: str
    framework: str
    world_size: int
    autolog: bool
    push: dict[str, Any] = field(default_factory=dict)
    strategy: str | None = None
    backend: str | None = None
    fresh: bool = False
    on: tuple[int, ...] | None = None
    kind: str = "cell"  # or "push": a %distrain push between cells (source empty)
    # The machines the ranks ran on, in rank order: (hostname, address, interface, workers).
    nodes: tuple[tuple[str, str, str | None, int], ...] = ()
    slurm_job: str | None = None  # the Slurm job the ranks ran in
    name: CellName = field(default_factory=CellName)  # as the notebook named it


_LOG = '''
_step = {}


def log(step=None, **metrics):
    """nbdist's log(...): in this script, one line per call on stdout, tagged with the rank."""
    if step is None:
        step = _step.get("n", 0)
    _step["n"] = step + 1
    values = " ".join(f"{k}={float(v):.6g}" for k, v in metrics.items())
    # One write per line: the ranks share torchrun's stdout, and print() writes the line and
    # its newline separately, so two ranks' lines could run into each other.
    sys.stdout.write(f"[rank {rank}] step {step} {values}\\n")
    sys.stdout.flush()
'''

_TORCH_AUTOLOG = """

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

_TORCH_SETUP = """
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

_TORCH_INIT = """
dist.init_process_group({backend})
rank = dist.get_rank()
world_size = dist.get_world_size()
is_main = rank == 0
"""

_TORCH_TEARDOWN = """\
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

_TORCH_OWN_INIT = """
# The cell calls init_process_group itself; rank and world_size come from torchrun's environment.
rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
is_main = rank == 0
"""

_TF_SETUP = """
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf

# TF_CONFIG (set by you, one per process) lists every worker and this process's index; it must
# be in the environment before TensorFlow runs its first op.
tf_config = json.loads(os.environ["TF_CONFIG"])
rank = tf_config["task"]["index"]
world_size = len(tf_config["cluster"]["worker"])
local_rank, local_world_size = rank, world_size  # one machine; adjust for several
is_main = rank == 0
_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
threads = max(1, _cores // local_world_size)
tf.config.threading.set_intra_op_parallelism_threads(threads)
tf.config.threading.set_inter_op_parallelism_threads(threads)

try:  # Keras 3's fit fails under multi-worker MWMS (keras-team/keras#20585): nbdist's fix
    from nbdist.engine.backends.tf_mwms import patch_keras

    patch_keras()
except ImportError:
    print("nbdist is not installed: Keras 3 model.fit may fail with several workers "
          "(keras-team/keras#20585)")

gpus = tf.config.list_physical_devices("GPU")
communication = tf.distribute.experimental.CommunicationOptions(
    implementation=tf.distribute.experimental.CommunicationImplementation.NCCL
    if gpus
    else tf.distribute.experimental.CommunicationImplementation.RING,
    timeout_seconds=30,  # a dead peer is reported instead of hanging
)
strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=communication)
"""

_TF_MIRRORED = """
import os
import sys

import tensorflow as tf

rank, world_size, local_rank, local_world_size, is_main = 0, 1, 0, 1, True
strategy = tf.distribute.MirroredStrategy()  # every GPU of this machine (CPU:0 without)
"""

_PUSH = """
import os
import pickle
import stat
import sys

# The notebook variables the cells were given with --push, saved next to this script. A pickle
# runs code when loaded: load only one this user owns and nobody else can write, opened once
# (never through a symbolic link) and checked on the open file.
_push_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), {name!r})
try:
    _fd = os.open(_push_path, os.O_RDONLY | os.O_NOFOLLOW)
except OSError as _e:
    sys.exit(f"cannot open {{_push_path}} ({{_e}}): it must be a file of yours, not a link")
with os.fdopen(_fd, "rb") as _f:
    _st = os.fstat(_f.fileno())
    if not stat.S_ISREG(_st.st_mode) or _st.st_uid != os.getuid():
        sys.exit(f"{{_push_path}} belongs to uid {{_st.st_uid}}, not to you: it could run "
                 "anything when loaded. Export the session again into a folder of your own.")
    if _st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        sys.exit(f"{{_push_path}} is writable by other users; check it, chmod 600 it, run again")
    _pushed = pickle.load(_f)
"""


_TORCH_INTERFACES = """
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


def _calls_log(tree: ast.AST) -> bool:
    """``log(...)`` or ``nbdist.log(...)``; not ``torch.log`` or ``np.log``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "log":
                return True
            if isinstance(f, ast.Attribute) and f.attr == "log":
                if isinstance(f.value, ast.Name) and f.value.id == "nbdist":
                    return True
    return False


def _cell_code(index: int, cell: CellRecord) -> str:
    if cell.kind == "push":
        title = f"# --- %distrain push {', '.join(cell.push)} "
        return title + "-" * (93 - len(title)) + f"\nglobals().update(_pushed[{index}])\n"
    body = textwrap.dedent(cell.source).strip("\n")
    if cell.fresh:
        # A --fresh cell ran in a namespace of its own, with its --push data: its names stay
        # inside the function.
        name = f"_fresh_cell_{index}"
        params = ", ".join(cell.push)
        call = f"{name}(**_pushed[{index}])" if cell.push else f"{name}()"
        body = f"def {name}({params}):\n{textwrap.indent(body, '    ')}\n\n\n{call}"
    elif cell.push:
        body = f"globals().update(_pushed[{index}])\n" + body
    if cell.on is not None:
        ranks = ", ".join(map(str, cell.on)) + ("," if len(cell.on) == 1 else "")
        body = f"if rank in ({ranks}):\n{textwrap.indent(body, '    ')}"
    name = cell.name.label if cell.name.count is not None else f"cell {index + 1}"
    title = f"# --- {name}" + (" (--fresh)" if cell.fresh else "") + " "
    return title + "-" * (93 - len(title)) + "\n" + body + "\n"


def export_script(
    cells: Sequence[CellRecord], path: str | Path, *, force: bool = False
) -> list[Path]:
    """Write the script (and the pushed data beside it); returns the files written.

    Refuses to replace existing files unless ``force``; the pushed data is written readable
    by the user only.
    """
    if not cells:
        raise ExportError("no %%distrain cell has run since the workers were last reset")
    path = Path(path)
    ran = [c for c in cells if c.kind == "cell"]
    if not ran:
        raise ExportError("no %%distrain cell has run since the workers were last reset")
    last = ran[-1]
    if len({c.framework for c in ran}) > 1:
        raise ExportError(
            "the session ran both torch and TensorFlow cells, which cannot share one script; "
            "%distrain reset, run the cells of one framework, then export"
        )
    data = path.with_name(path.stem + "_push.pkl")
    pushes = {i: c.push for i, c in enumerate(cells) if c.push}
    targets = [path, data] if pushes else [path]
    existing = [str(t) for t in targets if os.path.lexists(t)]  # a dangling link counts
    if existing and not force:
        raise ExportError(
            f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; choose "
            f"another name or add --force to replace {'it' if len(existing) == 1 else 'them'}"
        )
    written = [path]
    trees = [ast.parse(textwrap.dedent(c.source)) for c in ran]
    used = {name for name in ("init_process_group", "destroy_process_group")
            if any(any(calls(t, name)) for t in trees)}  # fmt: skip
    if any(_calls_log(t) for t in trees):
        used.add("log")
    explicit_log = "log" in used
    n = last.world_size
    if last.framework == "torch":
        run = f"torchrun --nproc_per_node {n} {path.name}"
        parts = [_TORCH_SETUP]
        if len(last.nodes) > 1:
            parts.append(_TORCH_INTERFACES.format(table=_interface_table(last.nodes)))
        if "init_process_group" in used:
            parts.append(_TORCH_OWN_INIT)
        else:
            chosen = repr(last.backend) if last.backend else "backend"
            parts.append(_TORCH_INIT.format(backend=chosen))
        parts.append(_LOG)
        if any(c.autolog for c in ran) and not explicit_log:
            parts.append(_TORCH_AUTOLOG)
        how = f"Run it with:\n\n    {run}\n"
        if last.slurm_job is not None:
            how = slurm_commands(last.nodes, path.name, last.slurm_job)
        elif len(last.nodes) > 1:
            how = multi_node_commands(last.nodes, path.name)
    else:
        if last.strategy == "mirrored":
            parts = [_TF_MIRRORED, _LOG]
            how = f"Run it with:\n\n    python {path.name}\n"
        else:
            parts = [_TF_SETUP, _LOG]
            workers = ", ".join(f'"localhost:{12345 + i}"' for i in range(n))
            how = (
                f"Run one process per worker, each with its own TF_CONFIG (here {n} on this "
                "machine):\n\n"
                + "\n".join(
                    f'    TF_CONFIG=\'{{"cluster": {{"worker": [{workers}]}}, '
                    f'"task": {{"type": "worker", "index": {i}}}}}\' python {path.name} &'
                    for i in range(n)
                )
                + "\n"
            )
    if pushes:
        # cloudpickle's: a class or function defined in the notebook goes by value (loading it
        # needs cloudpickle, which nbdist installs).
        write_new(data, pack(pushes).data, mode=0o600, replace=force)
        written.append(data)
        parts.insert(0, _PUSH.format(name=data.name))  # checked before anything else runs
    header = (  # raw: a Slurm header holds sed's backslashes
        f'r"""Exported from a %%distrain session by nbdist on {time.strftime("%Y-%m-%d")}.\n\n'
        f"{len(ran)} cell{'s' if len(ran) > 1 else ''} ran on {n} "
        f"worker{'s' if n > 1 else ''} ({last.framework}). {how}"
        '"""\n'
    )
    script = (
        header
        + "\n# --- what nbdist did before the cells "
        + "-" * 55
        + "\n"
        + "".join(parts).strip("\n")
        + "\n\n"
        + "\n".join(_cell_code(i, c) for i, c in enumerate(cells))
    )
    if last.framework == "torch" and "destroy_process_group" not in used:
        script += "\n# --- after the cells " + "-" * 72 + "\n" + _TORCH_TEARDOWN
    write_new(path, script.encode(), mode=0o644, replace=force)
    return written


def _umask() -> int:
    """This process's umask (reading it means setting it: put back at once)."""
    current = os.umask(0o077)
    os.umask(current)
    return current


def write_new(path: Path, data: bytes, *, mode: int, replace: bool) -> None:
    """Create ``path`` with ``data``, never through a symbolic link; an existing file (or
    link) is an ExportError unless ``replace``, and then replaced in one step: a new file
    beside it, renamed over it (a link someone planted there is replaced, its target left
    alone)."""
    if not replace:
        try:
            # O_EXCL: whatever is there, even a dangling link, fails instead of being written.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        except FileExistsError:
            raise ExportError(
                f"{path} already exists; choose another name or add --force to replace it"
            ) from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        # As a new file gets it (os.open applies the umask): under umask 077 the script, the
        # cells' source, stays this user's alone when it replaces one too.
        os.fchmod(fd, mode & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
