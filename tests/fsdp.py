"""FSDP2's ``fully_shard`` where this torch has it: public in ``torch.distributed.fsdp`` from
torch 2.6, under ``torch.distributed._composable.fsdp`` in 2.4 and 2.5 (the cells of the FSDP2
tests import it with this line, so that ``make compat`` runs them on those releases too)."""

from __future__ import annotations

import importlib.util


def fully_shard_import() -> str:
    """The line a cell imports ``fully_shard`` with, in the torch installed here."""
    try:
        public = importlib.util.find_spec("torch.distributed.fsdp._fully_shard") is not None
    except ModuleNotFoundError:
        public = False
    module = "torch.distributed.fsdp" if public else "torch.distributed._composable.fsdp"
    return f"from {module} import fully_shard\n"
