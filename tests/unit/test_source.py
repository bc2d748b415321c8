import pytest
from IPython.core.error import UsageError

from nbdist.kernel.source import parse_cell, used_frameworks


def test_empty_cell():
    with pytest.raises(UsageError, match="the cell is empty"):
        parse_cell("  \n\n")


def test_syntax_error_names_the_line():
    with pytest.raises(UsageError) as info:
        parse_cell("x = 1\nfor i in range(3)\n    pass\n")
    assert "syntax error at cell line 2: for i in range(3)" in str(info.value)
    assert "Nothing was run" in str(info.value)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import torch\n", {"torch"}),
        ("from torch.utils.data import DataLoader\n", {"torch"}),
        ("model = nn.Linear(2, 2)\n", {"torch"}),
        ("import tensorflow as tf\n", {"tf"}),
        ("with strategy.scope():\n    pass\n", {"tf"}),
        ("import torch\nimport tensorflow\n", {"torch", "tf"}),
        ("x = 1\n", set()),
    ],
)
def test_used_frameworks(source, found):
    assert used_frameworks(parse_cell(source)) == found
