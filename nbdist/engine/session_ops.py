"""What the session's line magics run on each engine: reset, pull, push, vars, compare, status.

Each takes and returns plain, picklable data, and runs between cells (an engine runs one task
at a time, so never while a cell does).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

from nbdist.engine.namespace import clear, free_memory, session_namespace, user_variables
from nbdist.engine.state import engine_state
from nbdist.protocol import MemoryReport, Packed, pack_values


def reset() -> MemoryReport:
    """Drop every variable the cells defined and give the memory back; the group stays."""
    from nbdist.engine import debugging

    debugging.forget()  # a failed cell's frames hold memory too
    dropped = clear(session_namespace())
    free_memory()
    return replace(memory(), dropped=dropped)


def pull(names: list[str], namespace: dict[str, Any] | None = None) -> Packed:
    """``{name: value}`` for ``names``, packed for the notebook (classes and functions of the
    cells go by value); raises ``NameError``/``TypeError`` naming the first one that is missing
    or cannot be sent, and what to pull instead."""
    return pack_values(
        _named(names, session_namespace() if namespace is None else namespace),
        lambda name, value, e: TypeError(
            f"{name} is a {type(value).__name__}, which cannot be sent to the notebook "
            f"({type(e).__name__}); pull a plain value instead, e.g. "
            f"{name}.state_dict(), {name}.tolist() or {name}.get_weights()"
        ),
    )


def push(values: Packed) -> list[str]:
    """Take the notebook's ``%distrain push`` values (rebuilt here: a failure names them)."""
    unpacked = values.unpack(" on this worker")
    session_namespace().update(unpacked)
    return sorted(unpacked)


def states(names: list[str]) -> bytes:
    """``%distrain sync``'s source: each of ``names`` as the other ranks take it (see
    :func:`take`), pickled as a healing pickles a session (functions and classes by value)."""
    from nbdist.engine.carry import dumps

    out: dict[str, tuple[str | None, Any]] = {}
    for name, value in _named(names, session_namespace()).items():
        value = _unwrapped(value)
        kind = _kind(value)
        if kind == "keras":
            out[name] = (kind, value.get_weights())
        else:
            out[name] = (kind, value.state_dict() if kind else value)
    return dumps(out)


def _named(names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """``{name: value}`` for ``names``; a ``NameError`` for the first the worker lacks."""
    for name in names:
        if name not in namespace:
            raise NameError(f"no variable {name!r} on this worker")
    return {name: namespace[name] for name in names}


def take(data: bytes) -> list[str]:
    """``%distrain sync`` elsewhere: a model's or an optimizer's state is loaded into the one
    here, in place (the optimizer goes on stepping the same parameters, the DDP wrapper goes on
    averaging them); anything else is replaced. Returns the names taken in place."""
    import pickle

    from nbdist.engine import healing
    from nbdist.engine.carry import loading

    namespace = session_namespace()
    with loading():
        values = pickle.loads(data)  # noqa: S301 - from this session's own engine
    # Keras models a rebuilt strategy builds again at the next cell, from a save: saved anew.
    rebuilt = engine_state().slot(healing.SLOT).get("keras") or {}
    in_place = []
    for name, (kind, value) in values.items():
        here = _unwrapped(namespace.get(name))
        if kind is not None and _kind(here) == kind:
            if kind == "keras":
                here.set_weights(value)
                if name in rebuilt:
                    rebuilt[name] = healing.saved_keras(here)
            else:
                here.load_state_dict(value)
            in_place.append(name)
        else:
            namespace[name] = value
    return sorted(in_place)


def _unwrapped(value: Any) -> Any:
    from nbdist.protocol import ddp_type

    ddp = ddp_type()
    return value.module if ddp is not None and isinstance(value, ddp) else value


def _kind(value: Any) -> str | None:
    """ "module", "optimizer" or "keras" (a model) for what :func:`take` loads in place; None
    for the rest."""
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(value, keras.Model):
        return "keras"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.nn.Module):
        return "module"
    if torch is not None and isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    return None


def describe_all() -> list[dict[str, Any]]:
    """One ``%distrain vars`` row per variable (see :func:`nbdist.engine.inspect.describe`)."""
    from nbdist.engine.inspect import describe

    return [
        describe(name, value) for name, value in sorted(user_variables(session_namespace()).items())
    ]


def flatten(name: str) -> dict[str, Any] | None:
    """The leaves of variable ``name`` to compare across ranks; None when this rank has no
    such variable (an ``--on`` cell may have made it on some ranks only)."""
    from nbdist.engine.inspect import flatten as leaves

    namespace = session_namespace()
    if name not in namespace:
        return None
    return leaves(namespace[name])


def memory() -> MemoryReport:
    """This engine's resident memory, the GPU memory its tensors hold (when torch has started
    CUDA), its GPUs (name, memory in use on each by every process) and how many variables the
    session namespace holds."""
    import psutil

    from nbdist.engine.hardware import gpu_info, visible_gpus

    proc = psutil.Process(os.getpid())
    rss = proc.memory_info().rss
    gpu = None
    torch = sys.modules.get("torch")  # never imported for this
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = torch.cuda.memory_allocated()
    return MemoryReport(
        rss=rss,
        gpu=gpu,
        gpus=gpu_info(visible_gpus()),
        variables=len(user_variables(session_namespace())),
    )
