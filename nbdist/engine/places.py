"""Where a session keeps objects nbdist must find again: a DDP model a rebuilt group wraps
anew, a data loader's ``DistributedSampler`` a healed rank reads its own shard with. A place is
a name, then attributes and items (``trainer.model``, ``models[0]``, ``train_data.sampler``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from nbdist.engine.namespace import is_user_name

# How deep places are looked for inside the user's own objects (a pasted ``Trainer`` holds a
# DDP model as ``self.model``): names, then attributes and items of those.
DEPTH = 3

Location = tuple[str, tuple[tuple[str, Any], ...]]  # a name, then ("attr", a) / ("item", key)


def label(location: Location) -> str:
    name, steps = location
    return name + "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in steps)


def locations(namespace: dict[str, Any], kind: type) -> dict[str, list[Location]]:
    """Where the session holds objects of ``kind`` (DDP models, distributed samplers): its
    names, the attributes and items of the user's own objects (a class defined in a cell, a
    dict, a list), and a data loader's sampler, ``DEPTH`` deep. One entry per object (a
    model may be both ``model`` and ``trainer.model``), by the first of its labels in sorted
    order, which every rank finds alike whatever order its namespace is in."""
    found: dict[int, list[Location]] = {}
    seen: set[int] = set()
    loader = getattr(sys.modules.get("torch.utils.data"), "DataLoader", None)

    def walk(value: Any, location: Location, depth: int) -> None:
        if isinstance(value, kind):
            found.setdefault(id(value), []).append(location)
            return
        if depth >= DEPTH or id(value) in seen:
            return
        seen.add(id(value))
        name, steps = location
        if isinstance(value, dict):
            items = [(("item", k), v) for k, v in value.items() if isinstance(k, (str, int))]
        elif isinstance(value, list):
            items = [(("item", i), v) for i, v in enumerate(value)]
        elif type(value).__module__ == "__main__" and isinstance(
            getattr(value, "__dict__", None), dict
        ):  # an object of a class the cells defined (not a library's: its insides are its own)
            items = [(("attr", k), v) for k, v in vars(value).items()]
        elif isinstance(loader, type) and isinstance(value, loader):
            items = [(("attr", "sampler"), getattr(value, "sampler", None))]
        else:
            return
        for step, item in items:
            walk(item, (name, (*steps, step)), depth + 1)

    for name, value in namespace.items():
        if is_user_name(name) and not isinstance(value, (type, types.ModuleType)):
            walk(value, (name, ()), 0)
    groups = [sorted(found_at, key=label) for found_at in found.values()]
    return {label(group[0]): group for group in sorted(groups, key=lambda g: label(g[0]))}


def get(namespace: dict[str, Any], location: Location) -> Any:
    name, steps = location
    value = namespace[name]
    for kind, key in steps:
        value = getattr(value, key) if kind == "attr" else value[key]
    return value


def put(namespace: dict[str, Any], location: Location, value: Any) -> None:
    name, steps = location
    if not steps:
        namespace[name] = value
        return
    owner = get(namespace, (name, steps[:-1]))
    kind, key = steps[-1]
    if kind == "attr":
        setattr(owner, key, value)
    else:
        owner[key] = value
