"""Looking at a worker's variables: one row of ``%distrain vars`` and the leaves ``compare`` checks.

This runs on the engines, next to the cell's namespace. It imports only the standard library at
module level; numpy, torch, TensorFlow and Keras are taken from ``sys.modules`` when the value in
hand comes from them (a torch tensor cannot exist unless torch is imported), so describing
``x = 3`` never imports a framework.

A value is compared through its *leaves*: ``flatten`` maps each readable path to a plain number,
string, ``None`` or numpy array. Paths read like the expression that reaches the leaf from the
variable, so the notebook can print ``name + path``:

- list and tuple items: ``[0]``, ``[1]``; namedtuple fields: ``.x``;
- dict entries: the key's repr in brackets, ``['lr']``, ``[0]``;
- ``nn.Module``: its ``state_dict`` names after a dot, ``.weight``, ``.module.0.bias`` (DDP keeps
  its ``module.`` prefix, as ``model.module.weight`` is where that tensor lives);
- torch optimizers: their ``state_dict``, ``.state[0]['exp_avg']``, ``.param_groups[0]['lr']``;
- Keras layers, models and optimizers: each variable's path (Keras 3) or name (Keras 2),
  less the object's own name, ``.dense/kernel``;
- the value itself, when it is a leaf: the empty path ``""``.

The leading dot is left off at the top, so a module's keys are ``weight``, ``bias``, as in its
``state_dict``.
"""

from __future__ import annotations

import cmath
import hashlib
import sys
from collections.abc import Iterator
from typing import Any

_COMPARABLE = (
    "compare numbers, strings, tensors, arrays, lists/tuples/dicts of them, nn.Module, "
    "Keras models or optimizers; or compare an attribute of it"
)
# Hashing walks big float arrays in slices this long, so normalising -0.0 and NaN before hashing
# costs 8 MB of scratch, not a copy of a whole embedding table.
_HASH_CHUNK = 1 << 20


def _module(name: str) -> Any:
    """An already imported module, or ``None``: a value of its types can only exist if it is."""
    return sys.modules.get(name)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str | None:
    """Which framework family ``value`` belongs to, without importing any framework."""
    np = _module("numpy")
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return "numpy"
    torch = _module("torch")
    if torch is not None:
        if isinstance(value, torch.Tensor):
            return "torch-tensor"
    # Keras first: under the torch backend a Keras layer is also an nn.Module.
    for name in ("keras", "tf_keras"):
        keras = _module(name)
        if keras is None:
            continue
        layer = getattr(getattr(keras, "layers", None), "Layer", None)
        if layer is not None and isinstance(value, layer):
            return "keras-layer"
        optimizer = getattr(getattr(keras, "optimizers", None), "Optimizer", None)
        if optimizer is not None and isinstance(value, optimizer):
            return "keras-optimizer"
        variable = getattr(keras, "Variable", None)
        if variable is not None and isinstance(value, variable):
            return "array-like"
    if torch is not None:
        if isinstance(value, torch.nn.Module):
            return "torch-module"
        if isinstance(value, torch.optim.Optimizer):
            return "torch-optimizer"
        if isinstance(value, (torch.device, torch.dtype)):
            return "str-like"
    tf = _module("tensorflow")
    if tf is not None and isinstance(value, (tf.Variable, tf.Tensor)):
        return "array-like"
    return None


def _tensor_to_numpy(tensor: Any) -> Any:
    import torch

    if tensor.is_meta:
        raise TypeError("cannot compare a meta tensor: it has no data")
    t = tensor.detach()
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        # A DTensor (FSDP2's parameters): what this rank holds is its local shard.
        t = t.to_local()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.dequantize()
    t = t.cpu().resolve_conj().resolve_neg()
    try:
        return t.numpy()
    except TypeError:  # numpy has no bfloat16 or float8; float32 holds their values exactly
        return t.float().numpy()


def _array_to_numpy(value: Any) -> Any:
    import numpy as np

    numpy_method = getattr(value, "numpy", None)
    return np.asarray(numpy_method() if callable(numpy_method) else value)


def _walk(value: Any, path: str, seen: frozenset[int]) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` pairs; ``seen`` holds the containers above, to stop on a cycle."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        yield path, value
        return
    kind = _kind(value)
    if kind == "numpy":
        import numpy as np

        if isinstance(value, np.generic):
            yield path, value.item()
        elif value.dtype.kind == "O":
            raise TypeError(
                f"cannot compare an object array{f' at {path}' if path else ''}: {_COMPARABLE}"
            )
        else:
            yield path, value
        return
    if kind == "torch-tensor":
        yield path, _tensor_to_numpy(value)
        return
    if kind == "array-like":
        yield path, _array_to_numpy(value)
        return
    if kind == "str-like":
        yield path, str(value)
        return
    if id(value) in seen:
        raise TypeError(f"cannot compare {_a(type(value).__name__)} that contains itself at {path}")
    seen = seen | {id(value)}
    if kind == "torch-module":
        for key, leaf in value.state_dict().items():
            yield from _walk(leaf, _join(path, key), seen)
    elif kind == "torch-optimizer":
        for key, part in value.state_dict().items():
            yield from _walk(part, _join(path, str(key)), seen)
    elif kind in ("keras-layer", "keras-optimizer"):
        yield from _walk_keras(value, path, seen)
    elif isinstance(value, tuple) and hasattr(type(value), "_fields"):
        for field, item in zip(type(value)._fields, value, strict=True):  # type: ignore[attr-defined]
            yield from _walk(item, _join(path, field), seen)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]", seen)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}[{key!r}]", seen)
    else:
        where = f" at {path}" if path else ""
        raise TypeError(f"cannot compare {_a(type(value).__name__)}{where}: {_COMPARABLE}")


def _walk_keras(value: Any, path: str, seen: frozenset[int]) -> Iterator[tuple[str, Any]]:
    if _kind(value) == "keras-layer":
        variables = value.weights
    else:
        variables = value.variables
        if callable(variables):  # Keras 2's legacy optimizers have a method, not a property
            variables = variables()
    # Keras 3 paths start with the model's own name, which Keras numbers per process
    # ("sequential", then "sequential_1" for the next model built): not part of the content.
    own = f"{getattr(value, 'name', '')}/"
    used: dict[str, int] = {}
    for variable in variables:
        name = (getattr(variable, "path", None) or variable.name).removeprefix(own)
        # Keras 2 can give two variables one name (two layers built with the same name=).
        n = used.get(name, 0)
        used[name] = n + 1
        yield from _walk(variable, _join(path, name if n == 0 else f"{name}#{n}"), seen)


def flatten(value: Any) -> dict[str, Any]:
    """The leaves of ``value`` to compare across ranks, keyed by a readable path.

    Parameters
    ----------
    value : Any
        A number, string, bytes, ``None``, numpy array or scalar, torch tensor (any device),
        ``tf.Tensor``/``tf.Variable``, list/tuple/dict of these, ``torch.nn.Module`` (DDP too),
        torch optimizer, Keras layer/model or Keras optimizer.

    Returns
    -------
    dict of str to Any
        Path (see the module docstring) to leaf: ``bool``/``int``/``float``/``complex``, ``str``,
        ``bytes``, ``None`` or a numpy array. Tensors are detached and copied to the CPU; a CPU
        tensor's array shares its memory (ipyparallel copies it when it sends it). bfloat16 and
        float8 tensors come back as float32, which holds their values exactly.

    Raises
    ------
    TypeError
        For any other type, anywhere inside ``value``, naming the types that compare.

    Examples
    --------
    >>> flatten({"lr": 0.1, "steps": [1, 2]})
    {"['lr']": 0.1, "['steps'][0]": 1, "['steps'][1]": 2}
    """
    return dict(_walk(value, "", frozenset()))


def digest(value: Any) -> str:
    """A short hash of ``value``'s leaves (:func:`flatten`): equal for values ``compare``
    calls identical."""
    return _digest(_walk(value, "", frozenset()))


def _hash_leaf(hasher: Any, leaf: Any) -> None:
    """Feed one leaf so that leaves ``compare`` calls equal hash equal (-0.0 == 0.0, NaN == NaN)."""
    if isinstance(leaf, complex) and cmath.isnan(leaf):
        leaf = complex("nan")  # one NaN for all, as compare counts any two NaNs equal
    elif isinstance(leaf, (float, complex)):
        leaf = leaf + 0.0  # -0.0 becomes 0.0 (NaN's repr is "nan" whatever its payload)
    if type(leaf).__module__ != "numpy":
        hasher.update(f"{type(leaf).__name__}:{leaf!r}".encode())
        return
    import numpy as np

    hasher.update(f"array:{leaf.dtype.str}:{leaf.shape}:".encode())
    flat = np.ascontiguousarray(leaf).reshape(-1)
    floating = leaf.dtype.kind in "fc"
    for start in range(0, max(flat.size, 1), _HASH_CHUNK):
        chunk = flat[start : start + _HASH_CHUNK]
        if floating:
            chunk = chunk + 0.0
            chunk[np.isnan(chunk)] = np.nan
        hasher.update(chunk.tobytes())


def _digest(leaves: Iterator[tuple[str, Any]]) -> str:
    # The sum of per-leaf hashes does not depend on the order the leaves come in: two dicts with
    # the same items inserted in another order compare equal, so they must hash equal.
    total = 0
    for key, leaf in leaves:
        hasher = hashlib.blake2b(key.encode(), digest_size=16)
        hasher.update(b"\0")
        _hash_leaf(hasher, leaf)
        total = (total + int.from_bytes(hasher.digest(), "big")) % (1 << 128)
    return f"{total:032x}"[:16]


def _short_dtype(dtype: Any) -> str:
    name = getattr(dtype, "name", None)
    text = name if isinstance(name, str) else str(dtype)
    return text.removeprefix("torch.")


def _tensor_facts(value: Any, kind: str | None) -> tuple[Any, Any, Any]:
    """(shape, dtype, device) for tensors and arrays; ``None`` for what has none."""
    if kind in ("numpy", "torch-tensor", "array-like") and hasattr(value, "shape"):
        shape = tuple(None if d is None else int(d) for d in value.shape)
        device = getattr(value, "device", None)
        if kind == "numpy":
            device = None  # numpy 2's ``device`` is always "cpu"; it says nothing here
        elif device is not None:
            # TensorFlow's "/job:worker/replica:0/task:1/device:CPU:0" → "CPU:0"
            device = str(device).rpartition("device:")[2]
        return shape, _short_dtype(value.dtype), device
    if kind == "torch-module":
        params = list(value.parameters())
        tensors = [*params, *value.buffers()]
        # The parameters' dtype: BatchNorm's int64 step counter would make every model "mixed".
        dtypes = {_short_dtype(t.dtype) for t in params or tensors}
        devices = {str(t.device) for t in tensors}
        return (
            None,
            (dtypes.pop() if len(dtypes) == 1 else "mixed") if dtypes else None,
            (devices.pop() if len(devices) == 1 else "mixed") if devices else None,
        )
    return None, None, None


def _params(value: Any, kind: str | None) -> int | None:
    try:
        if kind == "torch-module":
            return sum(p.numel() for p in value.parameters())
        if kind == "keras-layer":
            return int(value.count_params())
    except ValueError:  # a lazy torch module or an unbuilt Keras model has no sizes yet
        return None
    return None


def describe(name: str, value: Any) -> dict[str, Any]:
    """One row of the ``%distrain vars`` table for the variable ``name``.

    Parameters
    ----------
    name : str
        The variable's name in the worker's namespace.
    value : Any
        Its value.

    Returns
    -------
    dict
        Plain, picklable data::

            {"name": str, "type": str,           # "Tensor", "DistributedDataParallel", "int"
             "shape": tuple | None, "dtype": str | None, "device": str | None,
             "params": int | None,               # parameters of an nn.Module / Keras layer
             "digest": str,                      # equal on two ranks iff compare finds them equal
             "comparable": bool}

        ``digest`` hashes the leaves of ``flatten(value)``; for a value that does not flatten it
        hashes the type name only and ``comparable`` is ``False``. Describing never raises.
    """
    type_name = type(value).__name__
    kind = _kind(value)
    try:
        shape, dtype, device = _tensor_facts(value, kind)
        params = _params(value, kind)
    except Exception:  # a half-built object must not break the whole table
        shape = dtype = device = params = None
    try:
        digest = _digest(_walk(value, "", frozenset()))
        comparable = True
    except Exception:  # TypeError for what does not flatten; anything a state_dict() may raise
        digest = hashlib.blake2b(type_name.encode(), digest_size=8).hexdigest()
        comparable = False
    return {
        "name": name,
        "type": type_name,
        "shape": shape,
        "dtype": dtype,
        "device": device,
        "params": params,
        "digest": digest,
        "comparable": comparable,
    }
