"""PyTorch DistributedDataParallel: one default process group per rendezvous.

Lifecycle (see ``shared/NOTES.md`` for the measurements behind it):

* The group is created once per rendezvous and kept across runs: destroying a gloo group while
  a DDP model is alive can deadlock, and a re-used ``MASTER_PORT`` hangs. Warm runs pay nothing.
* Rank 0 opens the TCPStore on port 0 (the OS picks a free port) in ``prepare``; every new
  rendezvous therefore gets a fresh port.
* Every group has a finite collective timeout, so a lost peer is an error, never a hang.
* After a cell failed on every rank, :func:`healthy` runs a barrier with a short timeout; a
  group that passes keeps serving the session (the workers' variables stay).
* When the group is broken, the worker drops every variable, collects garbage and calls
  :func:`recover`, which destroys the group. Destroying it on a rank closes its connections,
  which frees peers blocked in an allreduce within a second (SIGINT does not) — but only once
  nothing else holds the group object: DDP models (dropped with the variables) and FSDP2's
  device meshes (:func:`_unpin_device_meshes`).
"""

from __future__ import annotations

import datetime
import gc
import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from nbdist.engine import debugging, hardware, profiling, stopping
from nbdist.engine.env import patch_environment
from nbdist.engine.libraries import libraries_join, reset_accelerate
from nbdist.engine.state import EngineState
from nbdist.protocol import Prepared, RankSpec

NAME = "torch"
TITLE = "torch"  # how messages name it
MODULE = "torch"  # what must be installed for it
# The names a cell of this framework uses (imports, bare names): how nbdist tells which one a
# cell is for.
CELL_NAMES = frozenset({"torch", "nn", "dist", "DistributedDataParallel", "DDP"})
FLAGS = ("backend", "profile")  # the %%distrain flags that are this framework's own
CHOSEN_BY: tuple[str, ...] = ()  # ... and those that choose it when --framework is not given
NOT_HERE: dict[str, str] = {}  # other frameworks' flags it has no equivalent of, and why
PRELOAD_AT_START = True  # importing torch starts no thread and touches no device
# What ranks that ran different numbers of steps should do instead.
SAME_STEPS = (
    "give every rank the same number of batches (DistributedSampler pads; drop_last=True), or "
    "wrap the loop in torch.distributed.algorithms.Join"
)
# On hosts whose names do not resolve, c10d logs a warning for each peer it connects to (it
# looks the peer's name up for its own log): left out of the cell, kept in the result's stderr.
# --profile: Kineto prints a line as the profiler starts and as it stops (to stderr).
OUTPUT_NOISE = (
    r"\[W\d{4} [\d:.]+(?: +\d+)? socket\.cpp:\d+\] \[c10d\] The hostname of the client "
    r"socket cannot be retrieved"
    r"|USDT:[\d-]+ [\d:]+ \d+:\d+ \w+\.cpp:\d+\] profiler_(?:start|stop)$"
)
# Stop ends a run at an optimizer step every rank reaches (stop_board: the TCPStore).
GRACEFUL_STOP = True
KEEPS_RENDEZVOUS_AFTER_FAILURE = False
RELEASE_FREES_PEERS = True  # a rank that destroys its group frees its blocked peers in ~1 s
SURVIVES_INTERRUPT = True  # an interrupted rank drops its group and works on
# Healing (nbdist.kernel.healing): new engines take the dead ranks, the survivors keep theirs,
# and every rank gets one survivor's variables; the next cell wraps the DDP models again.
NOT_HEALED = None  # (it heals)
FIXED_CLUSTER = None  # (its group can be made anew for other engines: not every one goes)
GROUP = "process group"  # what messages call what a failure rebuilds
REWRAP = "wraps {models} in DistributedDataParallel again"  # the next cell, for kept models
EXPORTER = "nbdist.kernel.export_torch"  # %distrain export's part for it (a kernel module)
# An engine's resident memory after a first small cell of it, the floor a start checks a
# memory limit against: measured here (torch 2.13's CPU build, Python 3.11, 2026-12-06; a
# bare engine is 66 MB). CUDA's context adds host memory on a GPU machine.
ENGINE_MB = 325
COLLECTIVE_TIMEOUT_S = 60

log = logging.getLogger(__name__)


def rendezvous_key(options: Mapping[str, Any], *, gpus: bool, world: int) -> tuple[Any, ...]:
    """What a process group is made for, with the defaults resolved (``--backend gloo`` on CPU
    is the group a cell without the flag gets). ``--timeout`` is left out: a group keeps the
    collective timeout it was made with."""
    return (NAME, options.get("backend") or ("nccl" if gpus else "gloo"), world)


def opens_servers(options: Mapping[str, Any]) -> bool:
    """Whether a job starts servers that accept code from anybody: not torch's."""
    return False


def workers_used(options: Mapping[str, Any], available: int) -> int:
    return available


def collective_timeout(options: Mapping[str, Any]) -> float:
    """Seconds a collective waits for a peer before it fails: the default, or ``--timeout``
    when shorter, for the group a cell makes (it keeps the timeout it was made with)."""
    limit = options.get("timeout")
    return min(COLLECTIVE_TIMEOUT_S, limit) if limit else COLLECTIVE_TIMEOUT_S


def peer_release_s(options: Mapping[str, Any]) -> float:
    """A rank that fails destroys its group, which frees blocked peers within about a second."""
    return 1.0


def preload() -> None:
    """Imports only (no CUDA initialisation): safe before the engine is pinned to its GPU."""
    # The first DDP() imports torch._dynamo (~800 modules, ~1.5-3 s); pay it here, not in a cell.
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401


# torch's flight recorder keeps each rank's last collectives (gloo's too, from torch 2.7): a
# stall's report then says which rank is behind, by how many collectives. Read when the group
# is made; ~50 us a collective, measured here on a 1 ms all-reduce. Set it to 0 to turn it off.
# (TORCH_NCCL_TRACE_BUFFER_SIZE is the name torch before 2.7 reads, for NCCL only.)
FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FLIGHT_RECORDER_ENTRIES = "256"


def warm_up(*, local_world_size: int, cpus: int) -> None:
    import torch

    for name in FLIGHT_RECORDER_ENV:
        os.environ.setdefault(name, FLIGHT_RECORDER_ENTRIES)
    preload()
    if not torch.cuda.is_available():
        # Two workers with all cores each would fight over them: split the cores.
        torch.set_num_threads(max(1, cpus // max(1, local_world_size)))


def _teardown(slot: dict[str, Any]) -> None:
    import torch.distributed as dist

    if not slot and not dist.is_initialized():
        return  # nothing to tear down; a full collection costs ~0.1 s on an engine with torch
    debugging.before_group_destroy()  # a failed cell's frames may hold a DDP model
    gc.collect()
    if dist.is_initialized():
        _unpin_device_meshes()
        dist.destroy_process_group()
    slot.clear()
    gc.collect()


def _unpin_device_meshes() -> None:
    """Drop the process groups that live ``DeviceMesh`` objects hold, so destroying the group
    closes this rank's connections.

    A gloo group's sockets close only when its last reference goes. ``fully_shard`` (and any
    DTensor) builds a ``DeviceMesh`` whose ``_pg_registry`` holds the group, and DTensor's
    redistribution and sharding caches keep the mesh for the process's life, past the model
    and past ``destroy_process_group``. Measured (torch 2.13, gloo, 2 processes): after an
    FSDP2 step a peer blocked in an all-reduce was freed only when the process exited; with
    the registries cleared before the destroy, in 0.6 s. The registry serves only while
    ``torch.compile`` traces through the mesh; a mesh of a destroyed group is dead anyway.
    The heap walk costs ~0.1 s, on top of the collections around it.
    """
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    mesh_type = getattr(device_mesh, "DeviceMesh", None)
    if not isinstance(mesh_type, type):
        return
    for obj in gc.get_objects():
        # Not isinstance(): DeviceMesh's metaclass would look into every object for a wrapped
        # mesh (and warn on some of them).
        if issubclass(type(obj), mesh_type):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


def prepare(
    *, rank: int, world_size: int, options: Mapping[str, Any], state: EngineState
) -> Prepared:
    import torch.distributed as dist

    slot = state.slot(NAME)
    _teardown(slot)
    if rank != 0:
        return Prepared()
    addr = options.get("master_addr", "127.0.0.1")
    # The store listens on the address the other ranks use (loopback for a local cluster), on a
    # port the OS picks; TCPStore on its own would listen on every interface.
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((addr, 0))
    listener.listen(128)
    store_args: dict[str, Any] = dict(
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    try:
        store = dist.TCPStore(addr, listener.getsockname()[1], world_size, True, **store_args)
    except NotImplementedError:
        # torch 2.4-2.7: the libuv store (their default) cannot take a listening socket
        # (pytorch#150215, fixed in 2.8); the older one can.
        store = dist.TCPStore(
            addr, listener.getsockname()[1], world_size, True, use_libuv=False, **store_args
        )
    listener.detach()  # the store owns the descriptor now and closes it when it goes
    slot["store"] = store
    return Prepared(info={"port": store.port})


def rendezvous(hosts: Sequence[str], prepared: Sequence[Prepared]) -> list[dict[str, str]]:
    """Per-rank environment, as torchrun gives its workers: the ``env://`` variables with rank
    0 as master, the node (``GROUP_*``) and role variables, and ``TORCHELASTIC_RUN_ID``, by
    which libraries (Lightning) recognise processes a launcher started for them; and
    Lightning's devices per node and nodes: for a ``Trainer`` as defaults (``PL_TRAINER_*``,
    its own arguments win), for ``Fabric`` as its CLI would give them (``LT_*``: they win over
    its arguments; ``Fabric()`` would otherwise take one device per process). Not
    ``TORCHELASTIC_USE_AGENT_STORE``: it would make a later ``env://`` rendezvous connect to
    nbdist's store instead of its own.
    """
    world = len(hosts)
    seen: dict[str, int] = {}
    local_ranks = []
    for host in hosts:
        local_ranks.append(seen.get(host, 0))
        seen[host] = seen.get(host, 0) + 1
    nodes = list(seen)
    port = str(prepared[0].info["port"])
    return [
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_ranks[rank]),
            "LOCAL_WORLD_SIZE": str(seen[host]),
            "MASTER_ADDR": hosts[0],
            "MASTER_PORT": port,
            "GROUP_RANK": str(nodes.index(host)),
            "GROUP_WORLD_SIZE": str(len(nodes)),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "TORCHELASTIC_RUN_ID": f"nbdist-{hosts[0]}-{port}",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "PL_TRAINER_DEVICES": str(seen[host]),
            "PL_TRAINER_NUM_NODES": str(len(nodes)),
            "LT_DEVICES": str(seen[host]),
            "LT_NUM_NODES": str(len(nodes)),
        }
        for rank, host in enumerate(hosts)
    ]


def socket_ifnames(
    master_addr: str, environ: Mapping[str, str], own_address: str | None
) -> dict[str, str]:
    """The ``*_SOCKET_IFNAME`` variables a rank sets before its group starts (none the user set).

    A local job (every rank on this host, ``MASTER_ADDR`` on loopback) keeps gloo's and NCCL's
    bootstrap sockets on loopback, unreachable from other hosts. Several hosts: gloo's own guess
    (the hostname's address) is often 127.0.1.1 on Debian-like hosts, so it gets the interface
    the other hosts reach this engine on; NCCL keeps its own choice (it may prefer InfiniBand).
    """
    if hardware.is_loopback(master_addr):
        iface = _loopback_interface()
        names: tuple[str, ...] = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    else:
        iface = hardware.interface_of(own_address) if own_address else None
        names = ("GLOO_SOCKET_IFNAME",)
    if iface is None:
        return {}
    return {name: iface for name in names if name not in environ}


def _loopback_interface() -> str | None:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


@contextmanager
def session(spec: RankSpec, state: EngineState) -> Iterator[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    slot = state.slot(NAME)
    backend = spec.options.get("backend") or ("nccl" if torch.cuda.is_available() else "gloo")
    port = int(os.environ["MASTER_PORT"])
    addr = os.environ["MASTER_ADDR"]
    same_group = dist.is_initialized() and slot.get("port") == port
    # Set for every run on the group (NCCL reads its variable when a communicator starts, which
    # may be at a cell's first collective) and restored after it, as the rank's own env is.
    ifnames = slot["ifnames"] if same_group else socket_ifnames(addr, os.environ, state.address)
    with patch_environment(ifnames):
        if not same_group:
            if dist.is_initialized():
                _teardown(slot)
            store = slot.get("store")
            if store is None:
                store = dist.TCPStore(
                    addr,
                    port,
                    spec.world_size,
                    False,
                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                )
            dist.init_process_group(
                backend,
                store=store,
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=datetime.timedelta(seconds=collective_timeout(spec.options)),
            )
            slot.update(port=port, store=store, backend=backend, ifnames=ifnames)
            reset_accelerate()  # its state was made for the group before this one
        if backend == "nccl":
            # Its own GPU among its host's (the local rank's, as under torchrun).
            device = torch.device("cuda", state.cuda_index or 0)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        with (
            _owned_process_group(slot["backend"], device),
            libraries_join(cpu=device.type == "cpu"),
            _autolog(state.recorder),
            _count_collectives(state.recorder),
            _no_process_launchers(spec.world_size),
            _stop_at_optimizer_steps(),
            profiling.profiled(spec.profile, device.type),
        ):
            yield {"torch": torch, "nn": torch.nn, "dist": dist, "device": device}


@contextmanager
def _no_process_launchers(world_size: int) -> Iterator[None]:
    """``torch.multiprocessing.spawn`` / ``start_processes`` raise at once while a cell runs.

    They are how code starts one process per rank: ``mp.spawn`` in a script's ``main``,
    Lightning's ``ddp_notebook``/``ddp_spawn``/``ddp_fork`` strategies, accelerate's
    ``notebook_launcher``. In a worker, which already is one rank of a group, the processes
    they start cannot join it: forked from an engine, they hung until ``--stall``.
    """
    import torch.multiprocessing as mp

    def refuse(name: str) -> Any:
        def launcher(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"torch.multiprocessing.{name}() starts worker processes from a %%distrain "
                f"cell, and this worker already is one of its {world_size} ranks: the processes "
                "it would start cannot join the group. Call the worker function directly, "
                "fn(rank, world_size); with Lightning use strategy='ddp' (not ddp_notebook, "
                "ddp_spawn or ddp_fork), with accelerate Accelerator() (not notebook_launcher)."
            )

        return launcher

    real = {name: getattr(mp, name) for name in ("spawn", "start_processes")}
    for name in real:
        setattr(mp, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(mp, name, fn)


def collectives_run() -> int:
    """Collectives this process has issued on all its process groups so far: each group counts
    its own in a sequence number (gloo and nccl alike; DDP's gradient all-reduce included)."""
    import torch.distributed.distributed_c10d as c10d

    total = 0
    for group in list(c10d._world.pg_map):
        try:
            total += group._get_sequence_number_for_group()  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # a backend that does not count
            continue
    return total


@contextmanager
def _count_collectives(recorder: Any) -> Iterator[None]:
    """Tell the recorder how many collectives ran on this rank during the cell."""
    if recorder is None:
        yield
        return
    before = collectives_run()
    try:
        yield
    finally:
        recorder.collectives = collectives_run() - before


@contextmanager
def _autolog(recorder: Any) -> Iterator[None]:
    """Capture, with no code in the cell, each scalar loss ``backward()`` is called on, the
    batch size of each forward pass of a distributed model (DDP, or FSDP2's ``fully_shard``),
    and how each step splits into this rank's own work and its wait for the others.

    ``wait`` is the time from the end of the backward's local computation (a callback queued
    from the loss's own node, so it runs before DDP's and FSDP's final callbacks, which wait for
    the gradient reduction) to the return of ``backward()``; ``work`` is the rest of the step,
    from the previous ``backward()``'s return. A rank that keeps the others waiting works longer
    and waits less: step times alone are equal on every rank of a synchronous job. Both go with
    the next point, like the batch size does.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    FSDPModule = _fsdp_module()

    if recorder is None or not recorder.autolog:
        yield
        return
    real_backward = torch.Tensor.backward
    run_callback = torch.autograd.Variable._execution_engine.queue_callback
    last_return: list[float] = []  # the previous backward()'s return, once there was one

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.numel() != 1:
            return real_backward(self, *args, **kwargs)
        recorder.auto(loss=self.detach())
        recorder.steps += 1
        computed: list[float] = []
        node = self.grad_fn
        handle = (
            node.register_prehook(lambda _g: run_callback(lambda: computed.append(time.time())))
            if node is not None
            else None
        )
        try:
            out = real_backward(self, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        done = time.time()
        if computed and last_return:
            recorder.pend(work=computed[0] - last_return[0], wait=done - computed[0])
        last_return[:] = [done]
        return out

    depth = threading.local()

    def counting(real: Any) -> Any:
        """``real`` (a forward) that pends the batch size of the outermost call only: FSDP2
        modules nest (each layer sharded, then the whole model)."""

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            level = getattr(depth, "n", 0)
            if level == 0:
                # DDP's module: the model a rebuilt group wraps again is the same model, and
                # its loss curve goes on.
                recorder.model(self.module if isinstance(self, DistributedDataParallel) else self)
                # The batch: the first argument, or the first tensor given by name
                # (transformers calls model(input_ids=..., labels=...)).
                first = args[0] if args else next(iter(kwargs.values()), None)
                shape = getattr(first, "shape", None)
                if shape:
                    recorder.pend(samples=int(shape[0]))
            depth.n = level + 1
            try:
                return real(self, *args, **kwargs)
            finally:
                depth.n = level

        return forward

    real_forward = DistributedDataParallel.forward

    def fsdp_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # fully_shard makes a class FSDP<Model>(FSDPModule, Model): the next forward in its
        # method resolution order after FSDPModule is the model's own.
        return super(FSDPModule, self).forward(*args, **kwargs)

    # Wrapping the distributed wrappers' forward, not a global module hook: a global hook would
    # put every module call of the model on torch's slower hook path. FSDPModule has no forward
    # of its own; one is set for the run and removed after it.
    # (mypy: assigning to a method is what this does)
    DistributedDataParallel.forward = counting(real_forward)  # type: ignore[method-assign]
    if FSDPModule is not None:
        FSDPModule.forward = counting(fsdp_forward)
    torch.Tensor.backward = backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = real_backward  # type: ignore[method-assign]
        DistributedDataParallel.forward = real_forward  # type: ignore[method-assign]
        if FSDPModule is not None:
            del FSDPModule.forward


def _fsdp_module() -> Any:
    """FSDP2's module class: ``torch.distributed.fsdp.FSDPModule`` from torch 2.6, under
    ``torch.distributed._composable.fsdp`` in 2.4 and 2.5; None before."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            return importlib.import_module(name).FSDPModule
        except (ImportError, AttributeError):
            continue
    return None


@contextmanager
def _owned_process_group(backend: str, device: Any) -> Iterator[None]:
    """Make a cell's own ``init_process_group``/``destroy_process_group`` calls harmless.

    Scripts written for torchrun call both; here nbdist already owns the group, so a second
    initialisation is skipped (it would raise) and the destroy is left to nbdist (destroying a
    group under a live DDP model can deadlock).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(backend_arg: str | None = None, *args: Any, **kwargs: Any) -> None:
        wanted = kwargs.get("backend", backend_arg)
        wanted = str(wanted).lower() if wanted is not None else None
        if wanted and wanted.startswith("nccl") and device.type != "cuda":
            raise RuntimeError(
                f"rank {dist.get_rank()}: init_process_group({wanted!r}) needs a GPU, and this "
                "worker has none. Use backend='gloo' or drop the argument: nbdist has already "
                "set up the process group."
            )
        log.info("process group already initialised by nbdist (%s); skipping", backend)

    def destroy_process_group(group: Any = None) -> None:
        if group is not None:
            real_destroy(group)

    for module in (dist, c10d):
        setattr(module, "init_process_group", init_process_group)  # noqa: B010
        setattr(module, "destroy_process_group", destroy_process_group)  # noqa: B010
    try:
        yield
    finally:
        for module in (dist, c10d):
            setattr(module, "init_process_group", real_init)  # noqa: B010
            setattr(module, "destroy_process_group", real_destroy)  # noqa: B010


def stop_board(spec: RankSpec, state: EngineState) -> Any:
    """The group's TCPStore, under keys of this run (see :mod:`nbdist.engine.stopping`)."""
    store = state.slot(NAME).get("store")
    return None if store is None else stopping.StoreBoard(store, spec.nonce or str(spec.run_id))


@contextmanager
def _stop_at_optimizer_steps() -> Iterator[None]:
    """Every optimizer's step is a step boundary for a graceful stop: a global pre-hook, so
    the stop comes before an update that no rank takes, after the previous iteration ran to
    its end (what the loop does after ``opt.step()`` included) on every rank alike."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: stopping.boundary("optimizer", before=True)
    )
    try:
        yield
    finally:
        handle.remove()


def healthy(state: EngineState, *, timeout: float) -> str | None:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return "no process group"
    wait = datetime.timedelta(seconds=timeout)
    try:
        if dist.get_backend() == "gloo":
            # Rank 0 hears from every rank or raises at the timeout, naming who is missing.
            dist.monitored_barrier(timeout=wait, wait_all_ranks=True)
        else:
            ones = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(ones, async_op=True).wait(timeout=wait)
            if ones.item() != dist.get_world_size():
                return f"all_reduce gave {ones.item():g}, not {dist.get_world_size()}"
    except Exception as e:  # any error here means the group cannot be trusted
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def recover(state: EngineState) -> None:
    _teardown(state.slot(NAME))
