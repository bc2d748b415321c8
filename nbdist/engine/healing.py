"""Healing a session after a worker died (torch): the engine side.

In a data-parallel session every surviving rank holds a whole replica of the model and the
optimizer, so a lost rank can be rebuilt from a survivor instead of every rank losing its
variables. The notebook (``nbdist.kernel.healing``) runs these on the engines:

1. every survivor :func:`leave_group`: each ``DistributedDataParallel`` in its namespace is
   replaced by the module it wraps (its parameters are the optimizer's, untouched) and the
   broken group is destroyed; the wrapped names are kept for step 4;
2. one survivor :func:`snapshot`: the namespace's variables that can be pickled, in one
   ``torch.save``, so that objects sharing tensors (a model and its optimizer) still share
   them on arrival; what cannot be sent is named with why;
3. every other rank (the new engine, and the other survivors, which may be a step apart after
   a collective that completed on some ranks only) :func:`restore` s it;
4. the next cell's group is new; before the cell runs, every rank wraps the same names in DDP
   again (:func:`rewrap`), whose constructor broadcasts rank 0's parameters and buffers.

TensorFlow cannot do steps 1-2: a ``MultiWorkerMirroredStrategy`` is configured once per
process for its cluster, and a dead peer poisons the survivors' collectives. Its honest best:
one survivor :func:`keras_snapshot` s its variables (each Keras model saved whole, ``.keras``:
architecture, weights, optimizer state), every engine is replaced, each new one
:func:`keep_for_strategy` s the snapshot, and before the next cell :func:`rewrap` loads the
models in the new strategy's scope, so they are distributed variables again.
"""

from __future__ import annotations

import io
from typing import Any

from nbdist.engine.namespace import session_namespace, user_variables
from nbdist.engine.state import engine_state
from nbdist.protocol import pickling_error

SLOT = "healing"


def leave_group(framework: str) -> dict[str, dict[str, Any]]:
    """Unwrap this rank's DDP models and destroy its part of the broken group; the variables
    stay. Returns the names that were DDP models, each with the constructor arguments kept.
    (Also how a rank that finished frees a peer blocked in a collective, when a rank died and
    the session will be healed: destroying the group closes its connections.)"""
    import gc

    from nbdist.engine import backends
    from nbdist.engine.env import sigint_ignored

    namespace = session_namespace()
    wrapped: dict[str, dict[str, Any]] = {}
    ddp = _ddp_type()
    with sigint_ignored():  # as drop_session: a half-left group would hang the next one
        if ddp is not None:
            for name in [n for n, v in namespace.items() if isinstance(v, ddp)]:
                model = namespace[name]
                wrapped[name] = _ddp_arguments(model)
                namespace[name] = model.module
            model = None
        gc.collect()  # the DDP objects (and their reducers) held the group
        backends.load(framework).recover(engine_state())
    # A second leave (a rank released to free its peers, then the healing) keeps the first's.
    slot = engine_state().slot(SLOT)
    slot["rewrap"] = wrapped = {**slot.get("rewrap", {}), **wrapped}
    return wrapped


def sharded() -> list[str]:
    """The variables whose state is split across the ranks (an FSDP2 model, DTensors, an
    optimizer over them): a survivor holds only its own shards, so they cannot be rebuilt."""
    import sys

    tensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if tensor is None:
        return []
    out = []
    for name, value in user_variables(session_namespace()).items():
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


def snapshot() -> tuple[bytes, list[str], dict[str, str]]:
    """This rank's variables as bytes (one ``torch.save``), the names in it, and the names
    that could not be sent with why (an open file, a generator, a data loader's iterator)."""
    import torch

    values = user_variables(session_namespace())
    unsent: dict[str, str] = {}
    buffer = io.BytesIO()
    try:  # one pass when everything can go (the usual case: a model twice is its size twice)
        torch.save(values, buffer)
    except Exception:  # noqa: BLE001 - then find what cannot go, and send the rest
        for name, value in values.items():
            e = pickling_error(value)
            if e is not None:
                unsent[name] = f"{type(value).__name__}: {type(e).__name__}"
        values = {n: v for n, v in values.items() if n not in unsent}
        buffer = io.BytesIO()
        torch.save(values, buffer)
    return buffer.getvalue(), sorted(values), unsent


def restore(data: bytes, rewrap: dict[str, dict[str, Any]]) -> list[str]:
    """Take a survivor's variables (``snapshot``); ``rewrap``: the names the next cell wraps
    in DDP again. Returns the names restored."""
    import torch

    values = torch.load(io.BytesIO(data), weights_only=False)
    namespace = session_namespace()
    namespace.update(values)
    engine_state().slot(SLOT)["rewrap"] = rewrap
    return sorted(values)


def keras_snapshot() -> tuple[bytes, list[str], dict[str, str]]:
    """TensorFlow: this rank's variables as bytes, the names in them, and what could not be
    sent with why. Keras models go whole (``model.save``); other TensorFlow objects (a dataset,
    a tensor of the old strategy, the strategy itself) cannot: the new engines have a new
    strategy, and they must be made in its scope again."""
    import pickle
    import tempfile

    import keras

    models: dict[str, bytes] = {}
    plain: dict[str, bytes] = {}
    unsent: dict[str, str] = {}
    for name, value in user_variables(session_namespace()).items():
        module = type(value).__module__.split(".")[0]
        if isinstance(value, keras.Model):
            with tempfile.TemporaryDirectory() as folder:
                path = f"{folder}/{name}.keras"
                value.save(path)
                with open(path, "rb") as f:
                    models[name] = f.read()
        elif module in ("keras", "tensorflow", "tf_keras"):
            unsent[name] = f"{type(value).__name__}: TensorFlow object of the old strategy"
        else:
            try:
                plain[name] = pickle.dumps(value)
            except Exception as e:  # noqa: BLE001 - why it cannot go is the answer
                unsent[name] = f"{type(value).__name__}: {type(e).__name__}"
    return pickle.dumps((models, plain)), sorted([*models, *plain]), unsent


def keep_for_strategy(data: bytes) -> list[str]:
    """TensorFlow, on a new engine: take a survivor's variables (:func:`keras_snapshot`); the
    Keras models among them are built at the next cell, in its strategy's scope
    (:func:`rewrap`). Returns the names of those models."""
    import pickle

    models, plain = pickle.loads(data)  # noqa: S301 - from this session's own engine
    namespace = session_namespace()
    namespace.update({name: pickle.loads(value) for name, value in plain.items()})  # noqa: S301
    engine_state().slot(SLOT)["keras"] = models
    return sorted(models)


def rewrap(namespace: dict[str, Any], names: dict[str, Any] | None = None) -> list[str]:
    """Before the first cell on a new group: wrap the models a healing unwrapped in DDP again,
    in the same order on every rank (each constructor is a collective); TensorFlow: load the
    Keras models a healing kept in the new strategy's scope (``names["strategy"]``). Returns
    their names."""
    models = engine_state().slot(SLOT).pop("keras", None)
    if models:
        return _load_keras(namespace, models, names or {})
    wrapped = engine_state().slot(SLOT).pop("rewrap", None)
    if not wrapped:
        return []
    from torch.nn.parallel import DistributedDataParallel

    names = sorted(n for n in wrapped if n in namespace)  # dropped since: nothing to wrap
    for name in names:
        namespace[name] = DistributedDataParallel(namespace[name], **wrapped[name])
    return names


def _load_keras(namespace: dict[str, Any], models: dict[str, bytes], names: dict[str, Any]):
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


def _ddp_type() -> type | None:
    import sys

    parallel = sys.modules.get("torch.nn.parallel")
    return getattr(parallel, "DistributedDataParallel", None)
