"""nbval compares only executed cells: a stripped notebook would pass vacuously. Not here."""

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_tutorials():
    assert [p.name for p in NOTEBOOKS][:1] == ["01_first_distributed_cell.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_was_executed_in_order(path):
    nb = nbformat.read(path, as_version=4)
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert None not in counts, f"{path.name}: unexecuted cells; run `make notebooks`"
    assert counts == list(range(1, len(counts) + 1)), f"{path.name}: re-run it top to bottom"
