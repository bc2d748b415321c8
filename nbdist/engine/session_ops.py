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
from nbdist.protocol import MemoryReport, pickling_error


def reset() -> MemoryReport:
    """Drop every variable the cells defined and give the memory back; the group stays."""
    dropped = clear(session_namespace())
    free_memory()
    return replace(memory(), dropped=dropped)


def pull(names: list[str], namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{name: value}`` for ``names``; raises ``NameError``/``TypeError`` naming the first one
    that is missing or cannot be pickled, and what to pull instead."""
    namespace = session_namespace() if namespace is None else namespace
    out = {}
    for name in names:
        if name not in namespace:
            raise NameError(f"no variable {name!r} on this worker")
        value = namespace[name]
        e = pickling_error(value)
        if e is not None:
            raise TypeError(
                f"{name} is a {type(value).__name__}, which cannot be sent to the notebook "
                f"({type(e).__name__}); pull a plain value instead, e.g. {name}.state_dict(), "
                f"{name}.tolist() or {name}.get_weights()"
            ) from None
        out[name] = value
    return out


def push(values: dict[str, Any]) -> list[str]:
    session_namespace().update(values)
    return sorted(values)


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
