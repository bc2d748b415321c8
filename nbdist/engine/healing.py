"""Healing a session after a worker died (torch): the engine side.

In a data-parallel session every surviving rank holds a whole replica of the model and the
optimizer, so a lost rank can be rebuilt from a survivor instead of every rank losing its
variables. The notebook (``nbdist.kernel.healing``) runs these on the engines:

1. every survivor :func:`leave_group`: each ``DistributedDataParallel`` in its namespace (or
   inside an object of the user's own: a ``Trainer`` keeps one as ``self.model``) is replaced
   by the module it wraps (its parameters are the optimizer's, untouched) and the broken group
   is destroyed; where each one was is kept for step 4;
2. one survivor :func:`snapshot` s its session: the variables that can be pickled, the
   functions and classes its cells defined, by value (cloudpickle), and its imports, by name,
   in one ``torch.save``, so that objects sharing tensors (a model and its optimizer) still
   share them on arrival; what cannot be sent is named with why;
3. every other rank (the new engine, and the other survivors, which may be a step apart after
   a collective that completed on some ranks only) :func:`restore` s it: the cells' imports
   first, then the rest, its functions bound to the session namespace there (see
   :func:`nbdist.engine.carry.pickler_class`), its tensors on that engine's own device;
4. the next cell's group is new; before the cell runs, every rank wraps the same models in DDP
   again where they were (:func:`rewrap`), whose constructor broadcasts rank 0's parameters and
   buffers.

Steps 1 and 4 alone are also how a group is rebuilt after an error that broke it (a rank
raised while its peers waited in a collective): every rank keeps its own variables.

TensorFlow cannot do steps 1-2: a ``MultiWorkerMirroredStrategy`` is configured once per
process for its cluster, and a dead peer poisons the survivors' collectives. Its honest best:
one survivor :func:`keras_snapshot` s its variables (each Keras model saved whole, ``.keras``:
architecture, weights, optimizer state), every engine is replaced, each new one
:func:`keep_for_strategy` s the snapshot, and before the next cell :func:`rewrap` loads the
models in the new strategy's scope, so they are distributed variables again.
"""

from __future__ import annotations

import io
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from nbdist.engine import carry, places
from nbdist.engine.namespace import session_namespace
from nbdist.engine.state import engine_state
from nbdist.protocol import ddp_type

SLOT = "healing"


@dataclass(frozen=True)
class Snapshot:
    """A rank's session, as bytes other ranks can take (:func:`snapshot`, :func:`restore`)."""

    data: bytes
    sent: list[str]  # the variables in it, functions and classes included
    modules: list[str]  # the names bound to modules (``np`` for ``import numpy as np``)
    unsent: dict[str, str] = field(default_factory=dict)  # name -> what it is, why not
    samplers: list[str] = field(default_factory=list)  # where its DistributedSamplers are


# -- the steps of a healing --------------------------------------------------------------------
Wrapped = dict[str, tuple[list[places.Location], dict[str, Any]]]  # label: where, DDP's arguments


def leave_group(framework: str) -> Wrapped:
    """Unwrap this rank's DDP models (in its names, or inside its own objects: a
    ``trainer.model``) and destroy its part of the broken group; the variables stay. Returns
    where each DDP model was, by label, with the constructor arguments kept. (Also how a rank
    that finished frees a peer blocked in a collective, when a rank died and the session will
    be healed, and how a group is rebuilt after an error: destroying the group closes its
    connections.)"""
    import gc

    from nbdist.engine import backends
    from nbdist.engine.env import sigint_ignored

    namespace = session_namespace()
    wrapped: Wrapped = {}
    # A torch group's models only: a TensorFlow cell that failed leaves torch's group alone.
    ddp = ddp_type() if framework == "torch" else None
    with sigint_ignored():  # as drop_session: a half-left group would hang the next one
        if ddp is not None:
            for label, where in places.locations(namespace, ddp).items():
                model = places.get(namespace, where[0])
                wrapped[label] = (where, _ddp_arguments(model))
                for place in where:
                    places.put(namespace, place, model.module)
            model = None
        gc.collect()  # the DDP objects (and their reducers) held the group
        if framework == "tf":
            _keep_keras_models(namespace)
        backends.load(framework).recover(engine_state())
    # A second leave (a rank released to free its peers, then the healing) keeps the first's.
    slot = engine_state().slot(SLOT)
    slot["rewrap"] = wrapped = {**slot.get("rewrap", {}), **wrapped}
    return wrapped


def _keep_keras_models(namespace: dict[str, Any]) -> None:
    """TensorFlow: the Keras models a new strategy builds again in its scope (:func:`rewrap`),
    saved whole; their variables belong to the strategy they were built in."""
    keras = sys.modules.get("keras")
    if keras is None:
        return
    models = {
        name: saved_keras(value) for name, value in carry.carried(namespace).items()
        if isinstance(value, keras.Model)
    }  # fmt: skip
    if models:
        engine_state().slot(SLOT)["keras"] = models


def saved_keras(model: Any) -> bytes:
    """A Keras model saved whole (``.keras``: architecture, weights, optimizer state)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/model.keras"
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def pending(framework: str = "torch") -> tuple[dict[str, str], list[str]]:
    """After ``framework``'s group was rebuilt: a digest of each model the next cell wraps in
    DDP (or builds in a new strategy's scope) again (equal digests, equal models: ``%distrain
    compare``'s test), by label, and the names of the optimizers, so that the notebook can say
    whether the replicas still agree."""
    from nbdist.engine.inspect import digest

    namespace = session_namespace()
    slot = engine_state().slot(SLOT)
    if framework == "tf":
        locations = {name: (name, ()) for name in slot.get("keras", {})}
    else:
        locations = {label: where[0] for label, (where, _) in slot.get("rewrap", {}).items()}
    digests = {}
    for label, location in locations.items():
        try:
            digests[label] = digest(places.get(namespace, location))
        except Exception:  # noqa: BLE001 - gone since, or not a model any more: not compared
            continue
    optim = sys.modules.get("torch.optim")
    kind = getattr(optim, "Optimizer", None)
    optimizers = sorted(
        name
        for name, value in carry.carried(namespace).items()
        if isinstance(kind, type) and isinstance(value, kind)
    )
    return digests, optimizers


def sharded() -> list[str]:
    """The variables whose state is split across the ranks (an FSDP2 model, DTensors, an
    optimizer over them): a survivor holds only its own shards, so they cannot be rebuilt."""
    tensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if tensor is None:
        return []
    out = []
    for name, value in carry.carried(session_namespace()).items():
        if isinstance(value, tensor):
            out.append(name)
            continue
        params = getattr(value, "parameters", None)
        groups = getattr(value, "param_groups", None)
        try:
            if callable(params):
                found = any(isinstance(p, tensor) for p in params())
            elif groups is not None:
                found = any(isinstance(p, tensor) for g in groups for p in g["params"])
            else:
                found = False
        except Exception:  # noqa: BLE001 - an object that only looks like a model
            found = False
        if found:
            out.append(name)
    return sorted(out)


def snapshot() -> Snapshot:
    """This rank's session as bytes (one ``torch.save``, so that objects sharing tensors, a
    model and its optimizer, still share them on arrival): its variables, the functions and
    classes its cells defined (by value, bound to the session namespace where they arrive),
    its imports (by name); what cannot be sent (an open file, a generator, a data loader's
    iterator) is named with why."""
    import torch

    values = carry.carried(session_namespace())
    unsent: dict[str, str] = {}
    module = carry.pickle_module()
    buffer = io.BytesIO()
    try:  # one pass when everything can go (the usual case: a model twice is its size twice)
        torch.save(values, buffer, pickle_module=module)
    except Exception:  # noqa: BLE001 - then find what cannot go, and send the rest
        for name, value in values.items():
            e = carry.pickling_error(value)
            if e is not None:
                unsent[name] = f"{type(value).__name__}: {type(e).__name__}"
        values = {n: v for n, v in values.items() if n not in unsent}
        buffer = io.BytesIO()
        torch.save(values, buffer, pickle_module=module)
    modules = sorted(n for n, v in values.items() if isinstance(v, types.ModuleType))
    sent = sorted(n for n in values if n not in modules)
    sampler = _sampler_type()
    samplers = list(places.locations(values, sampler)) if sampler is not None else []
    return Snapshot(buffer.getvalue(), sent, modules, unsent, samplers)


def _sampler_type() -> type | None:
    sampler = getattr(sys.modules.get("torch.utils.data.distributed"), "DistributedSampler", None)
    return sampler if isinstance(sampler, type) else None


def _own_samplers(namespace: dict[str, Any]) -> None:
    """After a healing gave this rank a survivor's session: each ``DistributedSampler`` (a data
    loader's shard of the dataset) set to this rank's own shard of the new group, its epoch
    kept. A survivor's would have this rank read the survivor's shard: every rank alike, the
    rest of the data never."""
    import torch.distributed as dist

    sampler = _sampler_type()
    if sampler is None or not dist.is_initialized():
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    for where in places.locations(namespace, sampler).values():
        s = places.get(namespace, where[0])
        if (s.rank, s.num_replicas) != (rank, world):
            epoch = s.epoch
            # Its own constructor: the shard's size follows from the group's.
            s.__init__(
                s.dataset, num_replicas=world, rank=rank, shuffle=s.shuffle, seed=s.seed,
                drop_last=s.drop_last,
            )  # fmt: skip
            s.epoch = epoch


def restore(
    snap: Snapshot,
    rewrap: Wrapped,
    imports: tuple[str, ...] = (),
) -> list[str]:
    """Take a survivor's session (:func:`snapshot`); ``rewrap``: where the next cell wraps
    DDP models again; ``imports``: the dotted modules the cells imported (``import a.b``
    binds only ``a``), imported first. Returns the names restored."""
    import torch

    _import_all(imports)
    state = engine_state()
    index = state.cuda_index

    def location(storage: Any, where: str) -> Any:
        # The survivor's tensors were on its own GPU: here, on this engine's.
        return storage.cuda(index) if index is not None and where.startswith("cuda") else storage

    with carry.loading():
        values = torch.load(io.BytesIO(snap.data), map_location=location, weights_only=False)
    namespace = session_namespace()
    namespace.update(values)
    state.slot(SLOT).update(rewrap=rewrap, resample=True)
    return sorted(values)


def _import_all(names: tuple[str, ...]) -> None:
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - as the cell that imported it would now fail: its turn
            continue


def keras_snapshot() -> Snapshot:
    """TensorFlow: this rank's session as bytes. Keras models go whole (``model.save``); other
    TensorFlow objects (a dataset, a tensor of the old strategy, the strategy itself) cannot:
    the new engines have a new strategy, and they must be made in its scope again. The rest
    goes as :func:`snapshot` sends it (functions and classes by value, modules by name)."""
    import pickle

    import keras

    models: dict[str, bytes] = {}
    plain: dict[str, bytes] = {}
    unsent: dict[str, str] = {}
    modules: list[str] = []
    for name, value in carry.carried(session_namespace()).items():
        module = type(value).__module__.split(".")[0]
        if isinstance(value, keras.Model):
            models[name] = saved_keras(value)
        elif module in ("keras", "tensorflow", "tf_keras"):
            unsent[name] = f"{type(value).__name__}: TensorFlow object of the old strategy"
        else:
            try:
                plain[name] = carry.dumps(value)
            except Exception as e:  # noqa: BLE001 - why it cannot go is the answer
                unsent[name] = f"{type(value).__name__}: {type(e).__name__}"
                continue
            if isinstance(value, types.ModuleType):
                modules.append(name)
    sent = sorted(n for n in [*models, *plain] if n not in modules)
    return Snapshot(pickle.dumps((models, plain)), sent, sorted(modules), unsent)


def keep_for_strategy(snap: Snapshot, imports: tuple[str, ...] = ()) -> list[str]:
    """TensorFlow, on a new engine: take a survivor's session (:func:`keras_snapshot`); the
    Keras models among them are built at the next cell, in its strategy's scope
    (:func:`rewrap`). Returns the names of those models."""
    import pickle

    _import_all(imports)
    models, plain = pickle.loads(snap.data)  # noqa: S301 - from this session's own engine
    namespace = session_namespace()
    with carry.loading():
        namespace.update({name: pickle.loads(value) for name, value in plain.items()})  # noqa: S301
    engine_state().slot(SLOT)["keras"] = models
    return sorted(models)


def rewrap(
    namespace: dict[str, Any], names: dict[str, Any] | None = None, framework: str = "torch"
) -> list[str]:
    """Before the first cell of ``framework`` on a new group: wrap the models a healing (or a
    rebuilt group) unwrapped in DDP again, where they were, in the same order on every rank
    (each constructor is a collective), on this engine's GPU; TensorFlow: load the Keras models
    kept in the new strategy's scope (``names["strategy"]``). What is kept for the other
    framework waits for its next cell. Returns their labels."""
    state = engine_state()
    if framework == "tf":
        models = state.slot(SLOT).pop("keras", None)
        return _load_keras(namespace, models, names or {}) if models else []
    if state.slot(SLOT).pop("resample", False):
        _own_samplers(namespace)
    wrapped = state.slot(SLOT).pop("rewrap", None)
    if not wrapped:
        return []
    from torch.nn.parallel import DistributedDataParallel

    done = []
    for label in sorted(wrapped):
        where, kwargs = wrapped[label]
        try:
            module = places.get(namespace, where[0])
        except (KeyError, AttributeError, IndexError, TypeError):  # dropped since
            continue
        if isinstance(module, DistributedDataParallel):  # wrapped again by the user
            continue
        if "device_ids" in kwargs and state.cuda_index is not None:
            kwargs = {**kwargs, "device_ids": [state.cuda_index], "output_device": state.cuda_index}
        model = DistributedDataParallel(module, **kwargs)
        for place in where:  # one wrapper wherever the one model was
            if places.get(namespace, place) is module:
                places.put(namespace, place, model)
        done.append(label)
    return done


def _load_keras(
    namespace: dict[str, Any], models: dict[str, bytes], names: dict[str, Any]
) -> list[str]:
    import contextlib
    import tempfile

    import keras

    strategy = names.get("strategy")
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as folder, scope:
        for name in sorted(models):  # the same order on every rank: variables are collective
            path = f"{folder}/{name}.keras"
            with open(path, "wb") as f:
                f.write(models[name])
            namespace[name] = keras.models.load_model(path)
    return sorted(models)


def _ddp_arguments(model: Any) -> dict[str, Any]:
    """The constructor arguments of a DDP model that are not the defaults (the ones a model
    built in a notebook sets: its GPU, unused parameters, no buffer sync)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    kwargs: dict[str, Any] = {}
    if getattr(model, "device_ids", None):
        kwargs["device_ids"] = list(model.device_ids)
        kwargs["output_device"] = model.output_device
    if getattr(model, "find_unused_parameters", False):
        kwargs["find_unused_parameters"] = True
    sync = getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", True))
    if not sync:  # torch 2.13 renamed it (and warns of the old name)
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        renamed = "forward_sync_buffers" in params
        kwargs["forward_sync_buffers" if renamed else "broadcast_buffers"] = False
    return kwargs
