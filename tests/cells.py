"""How nbdist names the cell a test runs: as IPython names it (``Cell In[12]``)."""

from __future__ import annotations

from typing import Any


def cell_in(shell: Any) -> str:
    """The label of the cell ``shell`` runs now (its execution count: ``run_cell_magic`` runs
    it under the current one)."""
    return f"Cell In[{shell.execution_count}]"
