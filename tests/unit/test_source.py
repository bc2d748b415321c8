import pytest
from IPython.core.error import UsageError

from nbdist.kernel.source import parse_cell, used_frameworks
from nbdist.protocol import CellName


def test_empty_cell():
    with pytest.raises(UsageError, match="the cell is empty"):
        parse_cell("  \n\n")


def test_syntax_error_names_the_line():
    with pytest.raises(UsageError) as info:
        parse_cell("x = 1\nfor i in range(3)\n    pass\n")
    # Lines as the editor shows them: the %%distrain line is line 1.
    assert "syntax error at the cell, line 3: for i in range(3)" in str(info.value)
    with pytest.raises(UsageError) as info:
        parse_cell("x = 1\nfor i in range(3)\n    pass\n", CellName(count=12, first_line=2))
    assert "syntax error at Cell In[12], line 3: for i in range(3)" in str(info.value)
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


def test_the_loops_own_range_gives_the_panel_its_eta():
    import ast

    from nbdist.kernel.display import table_html
    from nbdist.kernel.source import loop_steps

    def steps(src: str) -> int | None:
        return loop_steps(ast.parse(src))

    assert steps("for step in range(20):\n    loss.backward()\n") == 20
    assert steps("for e in range(3):\n    for s in range(10):\n        opt.step()\n") == 30
    assert steps("def one():\n    loss.backward()\nfor s in range(1, 9, 2):\n    one()\n") == 4
    with_join = "with Join([model]):\n    for s in range(7):\n        log(loss=1.0)\n"
    assert steps(with_join) == 7
    # The text does not say: a data loader, a bound that is a variable, two training loops.
    assert steps("for e in range(3):\n    for x in loader:\n        opt.step()\n") is None
    assert steps("for s in range(n):\n    opt.step()\n") is None
    assert steps("for s in range(5):\n    opt.step()\nfor s in range(5):\n    opt.step()\n") is None
    # In the table: 4 of 20 steps in 1 s, 16 to go.
    from nbdist.kernel.curves import Aggregate

    agg = Aggregate(1, start=100.0)
    agg.total_steps = 20
    agg.add([{"rank": 0, "step": s, "time": 100.0 + s, "loss": 1.0} for s in range(4)])
    assert "<td>1.0 s</td><td>4 s</td>" in table_html(agg, ["running"], now=101.0)
