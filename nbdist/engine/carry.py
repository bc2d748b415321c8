"""What a session is made of when it travels between engines (a healing's snapshot,
``%distrain sync``): every name the cells made, and the pickler that sends them.

cloudpickle sends what lives in ``__main__`` (the classes, functions and lambdas the cells
defined) by value, and what is importable by reference; modules go by name. Two things of a
session's are told apart (:func:`pickler_class`): functions bound to the session namespace are
bound to the receiving engine's, and nbdist's context objects (``log``, a strategy) are not sent.
"""

from __future__ import annotations

import contextlib
import io
import sys
import types
from collections.abc import Iterator
from typing import Any

from nbdist.engine.namespace import CONTEXT_NAMES, is_user_name, session_namespace


def carried(namespace: dict[str, Any]) -> dict[str, Any]:
    """What a healing carries of ``namespace``: every name the cells made, their imported
    modules included (a module goes by name, and is imported again where it arrives)."""
    return {name: value for name, value in namespace.items() if is_user_name(name)}


# -- pickling a session ------------------------------------------------------------------------
def _in_session() -> dict[str, Any]:
    return session_namespace()


class _SessionGlobals:
    """Stands for "the session namespace of the engine that loads this" in a pickle."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_in_session, ())


def _context_value(name: str) -> Any:
    """Where a snapshot held one of nbdist's context names (``log``, ``strategy``), the loading
    engine's own (the next cell sets it anew)."""
    return session_namespace().get(name)


def pickler_class() -> type:
    """cloudpickle's pickler, with two things of a session's told apart.

    cloudpickle sends a function defined in a cell by value, with a globals dict of its own
    holding the values it refers to: where it arrives it would go on seeing those objects
    after the next cell rebinds a name (after a healing, every DDP model is wrapped anew, and
    a restored ``train()`` would have trained the unwrapped module: no gradient averaging).
    Here a function whose globals are the session namespace gets the namespace of the engine
    that loads it instead (cloudpickle's own reduction, with its globals argument replaced).
    And nbdist's context objects that a function refers to (``log``, a strategy) are not sent:
    the loading engine's stand in.
    """
    import cloudpickle

    # cloudpickle's own reduction of a function (its globals are the second argument): where
    # a later cloudpickle reduces them otherwise, functions keep a globals dict of their own
    # (tests/integration/test_notebook_code.py checks that they do not).
    make_function = getattr(sys.modules["cloudpickle.cloudpickle"], "_make_function", None)

    class SessionPickler(cloudpickle.Pickler):
        def __init__(self, file: Any, protocol: int | None = None, **kwargs: Any) -> None:
            super().__init__(file, protocol=protocol, **kwargs)
            namespace = session_namespace()
            self._session = namespace
            self._context = {
                id(value): name
                for name, value in namespace.items()
                if name in CONTEXT_NAMES and not isinstance(value, (types.ModuleType, int, str))
            }

        def reducer_override(self, obj: Any) -> Any:
            name = self._context.get(id(obj))
            if name is not None:
                return (_context_value, (name,))
            reduced = super().reducer_override(obj)
            if (
                isinstance(obj, types.FunctionType)
                and obj.__globals__ is self._session
                and isinstance(reduced, tuple)
                and reduced[0] is make_function
                and make_function is not None
            ):
                code, _, name, defaults, closure = reduced[1]
                args = (code, _SessionGlobals(), name, defaults, closure)
                reduced = (reduced[0], args, *reduced[2:])
            return reduced

    return SessionPickler


def pickle_module() -> types.ModuleType:
    """``torch.save``'s ``pickle_module`` for a session (:func:`pickler_class`)."""
    module = types.ModuleType("nbdist_session_pickle")
    module.Pickler = pickler_class()  # type: ignore[attr-defined]
    return module


def dumps(value: Any) -> bytes:
    """``value`` pickled as a session's (:func:`pickler_class`)."""
    buffer = io.BytesIO()
    pickler_class()(buffer).dump(value)
    return buffer.getvalue()


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around loading a session's pickle: cloudpickle sets ``__builtins__`` in the globals of
    each function it rebuilds (here the session namespace): put back the namespace's own."""
    namespace = session_namespace()
    had = namespace.get("__builtins__", _NONE)
    try:
        yield
    finally:
        if had is _NONE:
            namespace.pop("__builtins__", None)
        else:
            namespace["__builtins__"] = had


_NONE = object()


def pickling_error(value: Any) -> Exception | None:
    """Why ``value`` cannot be sent as a session's (:func:`dumps`), or None."""
    try:
        dumps(value)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the answer
        return e
    return None
