"""Framework backends: one module per distributed strategy, behind one small interface.

A backend module provides:

``NAME``
    the ``--framework`` value it serves.
``KEEPS_RENDEZVOUS_AFTER_FAILURE``
    whether engines can run the next job on the same rendezvous after a rank failed.
``RELEASE_FREES_PEERS``
    whether a rank that is done can free peers blocked in a collective with it, by dropping
    its part of the group (``recover``) while they wait; if not, it is left alone until no
    rank waits any more.
``SURVIVES_INTERRUPT``
    whether an engine can run further cells after SIGINT interrupted one of its cells (if not,
    the engines are replaced).
``NOT_HEALED``
    why a session of it is never healed after a rank died (:mod:`nbdist.kernel.healing`), or
    None: it is.
``FIXED_CLUSTER``
    None where a healing replaces only the dead ranks' engines (the survivors keep theirs and
    leave the group; the next cell makes a new one); else the name of the group that cannot
    change its cluster, and a healing replaces every engine instead.
``GROUP`` and ``REWRAP``
    what messages call the group a failure rebuilds, and what the next cell does with the
    models kept (a format string of ``{models}``).
``EXPORTER``
    the module that writes its part of ``%distrain export``'s script (see
    :mod:`nbdist.kernel.export`).
``ENGINE_MB``
    an engine's resident memory after a first small cell of it (measured): the least each
    worker needs, which a start checks the kernel's memory limit against.
``OUTPUT_NOISE`` (optional)
    a regular expression for lines of the framework's own logging that the cell's output
    leaves out (they stay in the result's ``stderr``).
``workers_used(options, available)``
    how many of the available engines a job uses (1 for a single-process strategy).
``peer_release_s(options)``
    how long a rank blocked in a collective takes to notice that a peer is gone.
``preload()``
    imports only, run before an engine starts when its first cell's framework is known (no
    device or thread set-up: the engine is not pinned to its GPU yet).
``warm_up(*, local_world_size, cpus)``
    once per engine: import the framework (``preload``) and size its thread pools.
``prepare(*, rank, world_size, options, state)``
    once per new rendezvous, on every engine: the engine's part of it (e.g. a port it opened),
    as a ``nbdist.protocol.Prepared`` (``restart``: why this engine process cannot take part
    any more).
``rendezvous(hosts, prepared)``
    pure: engine hosts (in rank order) and what ``prepare`` returned → each rank's environment.
``session(spec, state)``
    a context manager around one run: makes the distributed runtime ready and yields the names
    the cell sees (``device``, ``strategy``, ...).
``healthy(state, *, timeout)``
    after a cell failed on every rank: None when the group still works (a check that returns
    within about ``timeout`` seconds), else why not.
``stop_board(spec, state)``
    during a run: where its ranks agree on the step a graceful stop ends at
    (:class:`nbdist.engine.stopping.Board`), or None where the backend has none (the notebook
    then interrupts the old way).
``recover(state)``
    once the cells' objects are gone: leave the engine ready for a new rendezvous (or a new
    strategy), and free peers still blocked in a collective.

and these constants: ``NAME`` (as ``--framework`` spells it), ``TITLE`` (as messages do),
``MODULE`` (what must be installed), ``CELL_NAMES`` (the names a cell of it uses),
``FLAGS`` (the %%distrain flags that are its own), ``NOT_HERE`` (other frameworks' flags it has
no equivalent of, each with why and what to do instead), ``CHOSEN_BY`` (those of them that choose it
when ``--framework`` is not given), ``PRELOAD_AT_START`` (whether engines may
import it as they start), ``SAME_STEPS`` (the fix for ranks that ran different numbers of
steps), ``KEEPS_RENDEZVOUS_AFTER_FAILURE``, ``RELEASE_FREES_PEERS``, ``SURVIVES_INTERRUPT``,
``OUTPUT_NOISE``; and ``rendezvous_key(options, *, gpus, world)`` (what a group is made for)
and ``opens_servers(options)`` (whether its job listens for code from anybody).

Adding a framework is one new module and one line in ``_MODULES``; or, from a package of its
own, an entry point in the ``nbdist.backends`` group (name = the module), found in the notebook's
kernel and in every engine that has the package installed::

    [project.entry-points."nbdist.backends"]
    jax = "nbdist_jax.backend"

nbdist's own names come first; an entry point cannot replace one.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

ENTRY_POINTS = "nbdist.backends"

_MODULES = {
    "torch": "nbdist.engine.backends.torch_ddp",
    "tf": "nbdist.engine.backends.tf_mwms",
}


@functools.cache
def _registry() -> dict[str, str]:
    """nbdist's backends, then those other packages register (scanned once: ~10 ms)."""
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}
    return {**found, **_MODULES}  # (an entry point cannot replace nbdist's own)


def frameworks() -> tuple[str, ...]:
    """Every framework's name, nbdist's own first (the first installed one is the default)."""
    return (*_MODULES, *(name for name in _registry() if name not in _MODULES))


def all_backends() -> list[ModuleType]:
    """Every backend, in :func:`frameworks` order."""
    return [load(name) for name in frameworks()]


def first_installed() -> str | None:
    """The first framework (in :func:`frameworks` order) whose module is installed here: the
    default for a cell that names none."""
    from importlib.util import find_spec

    return next((b.NAME for b in all_backends() if find_spec(b.MODULE) is not None), None)


def load(framework: str) -> ModuleType:
    """The backend module for ``framework`` (imports no framework itself)."""
    module = _MODULES.get(framework) or _registry().get(framework)
    if module is None:
        known = ", ".join(frameworks())
        raise ValueError(f"unknown framework {framework!r}; use one of: {known}")
    return importlib.import_module(module)
