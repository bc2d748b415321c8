"""The workers' variables: one namespace per engine that lives from cell to cell.

A ``%%distrain`` cell runs in the engine's own IPython user namespace, the one ipyparallel's
``%%px`` and ``view.pull`` use, so a model built in one cell is there in the next, and ``%%px``
sees the same variables. (An engine started without IPython falls back to a dict kept in
:class:`~nbdist.engine.state.EngineState`.)

The *context* names (``rank``, ``device``, ``log``, ``strategy``, ...) are set again before
every cell; they are nbdist's, not the user's, and are left out of every listing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
import types
from typing import Any

from nbdist.engine.state import engine_state

# Set by the worker before each cell; the backends add their own (torch, nn, dist, device, tf,
# strategy), listed here so listings and clears treat them alike.
CONTEXT_NAMES = frozenset(
    {
        "rank",
        "world_size",
        "local_rank",
        "local_world_size",
        "is_main",
        "log",
        "device",
        "torch",
        "nn",
        "dist",
        "tf",
        "strategy",
    }
)
# What IPython itself keeps in a user namespace.
_IPYTHON_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython", "open"})


def _shell() -> Any:
    if "IPython" not in sys.modules:  # an ipyparallel engine is an IPython kernel: imported
        return None
    from IPython import get_ipython

    return get_ipython()


def session_namespace() -> dict[str, Any]:
    """This engine's persistent namespace (the IPython user namespace when there is one)."""
    shell = _shell()
    if shell is not None:
        return shell.user_ns
    return engine_state().namespace


def is_user_name(name: str) -> bool:
    return not name.startswith("_") and name not in _IPYTHON_NAMES and name not in CONTEXT_NAMES


def user_variables(namespace: dict[str, Any]) -> dict[str, Any]:
    """The user's variables, functions and classes (imported modules left out), by name."""
    return {
        name: value
        for name, value in namespace.items()
        if is_user_name(name) and not isinstance(value, types.ModuleType)
    }


def clear(namespace: dict[str, Any]) -> list[str]:
    """Remove everything the cells defined (modules and context names too); returns the names
    of the variables that were dropped, sorted, modules left out."""
    dropped = sorted(user_variables(namespace))
    for name in [n for n in namespace if is_user_name(n) or n in CONTEXT_NAMES]:
        del namespace[name]
    # IPython's output cache holds on to %%px results (Out, _, __, ___ and _1, _2, ...): a
    # model shown there stays alive. The shell's displayhook knows every place it keeps them.
    shell = _shell()
    if shell is not None and shell.user_ns is namespace:
        shell.displayhook.flush()
    else:
        out = namespace.get("Out")
        if isinstance(out, dict):
            out.clear()
        for name in ("_", "__", "___"):
            if name in namespace:
                namespace[name] = ""
    return dropped


def free_memory() -> None:
    """Collect garbage and give freed memory back: heap to the OS (glibc keeps it otherwise),
    GPU memory to the device (torch's caching allocator keeps it otherwise, and nvidia-smi would
    still show it in use)."""
    gc.collect()
    torch = sys.modules.get("torch")  # never imported for this
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        libc = ctypes.util.find_library("c")
        if libc:
            try:
                ctypes.CDLL(libc).malloc_trim(0)
            except (OSError, AttributeError):  # musl has no malloc_trim
                pass
