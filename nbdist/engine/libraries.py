"""What the training libraries people bring read to decide they run distributed.

Under torchrun, Hugging Face ``Trainer``, accelerate's ``Accelerator()`` and Lightning find the
launcher's environment and join its process group. In a ``%%distrain`` cell the group exists
already, but each library also looks at something nbdist's workers did not give it (read from
their sources, accelerate 1.16, transformers 5.25, Lightning 2.6):

* accelerate (and ``Trainer``, which builds on it) picks ``MULTI_CPU`` only when asked for the
  CPU (``Accelerator(cpu=True)``, ``TrainingArguments(use_cpu=True)``, or
  ``ACCELERATE_USE_CPU``); otherwise, without a GPU, ``DistributedType.NO``: every rank trains
  its own copy. Workers without a GPU get ``ACCELERATE_USE_CPU=1`` (never GPU workers: it would
  force gloo where the group is nccl). Its state is a process-wide singleton: a new process group
  (a new rendezvous) resets it, as a new torchrun process would start without one.
* Lightning refuses ``strategy="ddp"`` in "an interactive environment" (``_IS_INTERACTIVE``,
  computed from ``sys.ps1`` at import and copied into several modules; an engine is an IPython
  kernel, so it has ``sys.ps1``), and recognises a launcher that started the processes itself by
  ``TORCHELASTIC_RUN_ID`` (the torchrun variables come from the backend's ``rendezvous``). While
  a cell runs, ``sys.ps1`` is gone, and every copy of the flag is False (and stays so: nobody
  uses Lightning interactively in an engine).

The environment a cell sees is set by the worker (``RankSpec.env``) and this module's
:func:`libraries_join` adds the rest; both are restored when the cell ends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from nbdist.engine.env import patch_environment

# Every module that copies Lightning's _IS_INTERACTIVE at import (``from ... import``), under
# both package layouts (``lightning``, and standalone ``lightning_fabric``/``pytorch_lightning``).
_LIGHTNING_COPIES = tuple(
    f"{root}.{module}"
    for roots, modules in (
        (
            ("lightning.fabric", "lightning_fabric"),
            (
                "utilities.imports",
                "connector",
                "strategies.launchers.multiprocessing",
            ),
        ),
        (
            ("lightning.pytorch", "pytorch_lightning"),
            (
                "trainer.connectors.accelerator_connector",
                "callbacks.progress.rich_progress",
                "strategies.launchers.multiprocessing",
            ),
        ),
    )
    for root in roots
    for module in modules
)


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state, when accelerate is loaded: it was made for a
    process group that is gone (a torchrun process would start without it)."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()


@contextmanager
def libraries_join(*, cpu: bool) -> Iterator[None]:
    """While a cell runs: accelerate's CPU switch on workers without a GPU (``cpu``), and no
    interactive shell for Lightning to see (see the module docstring)."""
    with patch_environment({"ACCELERATE_USE_CPU": "1"} if cpu else {}), _not_interactive():
        yield


@contextmanager
def _not_interactive() -> Iterator[None]:
    had_ps1, ps1 = hasattr(sys, "ps1"), getattr(sys, "ps1", None)
    if had_ps1:
        del sys.ps1  # for Lightning imported in the cell
    for name in _LIGHTNING_COPIES:  # ... and the copies of the flag imported before it
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_IS_INTERACTIVE", False):
            setattr(module, "_IS_INTERACTIVE", False)  # noqa: B010 - a module's flag
    try:
        yield
    finally:
        if had_ps1:
            sys.ps1 = ps1
