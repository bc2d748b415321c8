"""``%distrain compare`` and ``%distrain vars``, built from what each rank's inspect sends."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from nbdist.engine.inspect import describe, flatten
from nbdist.kernel.compare import CompareResult, Difference, VarsRow, compare, vars_table


def linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def nudged(by=1e-3):
    model = linear()
    with torch.no_grad():
        model.weight[1, 2] += by
    return model


def test_replicas_built_with_one_seed_are_identical():
    result = compare("model", [flatten(linear()), flatten(linear())])
    assert result == CompareResult(
        name="model", world_size=2, identical=True, max_abs_diff=0.0, entries=2, differences=()
    )
    assert bool(result) is True
    assert repr(result) == "model: identical on 2 ranks (2 entries)"
    assert result._repr_html_() == "<p><b>model: identical on 2 ranks (2 entries)</b></p>"


def test_a_nudged_weight_is_named_with_its_rank_and_size():
    result = compare("model", [flatten(linear()), flatten(nudged())])
    assert not result and result.identical is False
    assert result.entries == 2
    (diff,) = result.differences
    assert (diff.entry, diff.ranks, diff.detail) == ("weight", (1,), "max |diff| 1.0e-03")
    assert diff.max_abs_diff == pytest.approx(1e-3, rel=1e-4)
    assert result.max_abs_diff == diff.max_abs_diff
    assert repr(result).splitlines() == [
        "model: differs across 2 ranks in 1 of 2 entries, max |diff| 1.0e-03",
        "  entry         ranks  what differs",
        "  model.weight  1      max |diff| 1.0e-03",
    ]


def test_only_the_ranks_that_differ_are_listed():
    result = compare("model", [flatten(linear()), flatten(linear()), flatten(nudged(0.5))])
    assert [(d.entry, d.ranks) for d in result.differences] == [("weight", (2,))]
    assert result.max_abs_diff == pytest.approx(0.5, rel=1e-6)


def test_missing_dict_keys_either_way():
    flats = [flatten({"a": 1, "b": 2}), flatten({"a": 1}), flatten({"a": 1, "b": 2, "c": 3})]
    result = compare("cfg", flats)
    assert result.entries == 3
    assert result.differences == (
        Difference(entry="['b']", ranks=(1,), max_abs_diff=math.inf, detail="missing on rank 1"),
        Difference(
            entry="['c']", ranks=(2,), max_abs_diff=math.inf, detail="missing on ranks 0, 1"
        ),
    )
    assert result.max_abs_diff == math.inf
    assert "  cfg['b']  1      missing on rank 1" in repr(result).splitlines()


def test_shape_dtype_and_type_mismatches():
    shape = compare("x", [flatten(np.zeros(3)), flatten(np.zeros(4))])
    assert shape.differences == (
        Difference(entry="", ranks=(1,), max_abs_diff=math.inf,
                   detail="shape (3,) on rank 0, (4,) on rank 1"),
    )  # fmt: skip
    assert repr(shape).splitlines()[-1] == "  x      1      shape (3,) on rank 0, (4,) on rank 1"
    dtype = compare("x", [flatten(torch.zeros(2)), flatten(torch.zeros(2, dtype=torch.float64))])
    assert dtype.differences[0].detail == "dtype float32 on rank 0, float64 on rank 1"
    kind = compare("n", [flatten(1), flatten(1.0), flatten(1.0)])
    assert kind.differences[0].detail == "int on rank 0, float on ranks 1, 2"
    assert kind.differences[0].ranks == (1, 2)


def test_different_shapes_on_several_ranks_are_grouped():
    flats = [flatten(np.zeros(3)), flatten(np.zeros(4)), flatten(np.zeros(4)), flatten(np.zeros(5))]
    (diff,) = compare("x", flats).differences
    assert diff.ranks == (1, 2, 3)
    assert diff.detail == "shape (3,) on rank 0, (4,) on ranks 1, 2, (5,) on rank 3"


def test_nan_at_the_same_positions_counts_equal():
    a = np.array([1.0, np.nan, np.inf, -0.0])
    assert compare("x", [flatten(a), flatten(np.array([1.0, np.nan, np.inf, 0.0]))]).identical
    assert compare("x", [flatten(math.nan), flatten(math.nan)]).identical
    moved = compare("x", [flatten(a), flatten(np.array([np.nan, 1.0, np.inf, 0.0]))])
    assert moved.max_abs_diff == math.inf
    assert moved.differences[0].detail == "max |diff| inf"


def test_differences_are_exact_where_narrow_dtypes_would_overflow():
    half = [flatten(np.array([60000.0], np.float16)), flatten(np.array([-60000.0], np.float16))]
    assert compare("h", half).max_abs_diff == 120000.0
    int8 = [flatten(np.array([127], np.int8)), flatten(np.array([-128], np.int8))]
    assert compare("i", int8).max_abs_diff == 255.0
    # 2**60 and 2**60 + 1 are one float64: the difference still shows, as at least 1.
    big = [flatten(np.array([2**60], np.int64)), flatten(np.array([2**60 + 1], np.int64))]
    assert compare("b", big).max_abs_diff == 1.0
    assert compare("b", [flatten(2**60), flatten(2**60 + 1)]).max_abs_diff == 1.0
    assert compare("b", [flatten(10**400), flatten(-(10**400))]).max_abs_diff == math.inf


def test_bools_and_strings():
    flags = compare("f", [flatten([True, False]), flatten([True, True])])
    assert [(d.entry, d.max_abs_diff) for d in flags.differences] == [("[1]", 1.0)]
    names = compare("s", [flatten({"run": "a"}), flatten({"run": "b"})])
    assert names.differences == (
        Difference(entry="['run']", ranks=(1,), max_abs_diff=math.inf,
                   detail="'a' on rank 0, 'b' on rank 1"),
    )  # fmt: skip
    assert compare("s", [flatten(None), flatten(None)]).identical


def step(model, opt, times):
    for _ in range(times):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()


def test_optimizer_state_after_steps():
    replicas = []
    for times, lr in ((1, 0.1), (1, 0.1), (2, 0.1), (1, 0.2)):
        model = linear()
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        step(model, opt, times)
        replicas.append(flatten(opt))
    assert compare("opt", replicas[:2]).identical
    twice = compare("opt", [replicas[0], replicas[2]])
    assert [d.entry for d in twice.differences] == [
        "state[0]['step']", "state[0]['exp_avg']", "state[0]['exp_avg_sq']",
        "state[1]['step']", "state[1]['exp_avg']", "state[1]['exp_avg_sq']",
    ]  # fmt: skip
    assert twice.differences[0].max_abs_diff == 1.0
    lr = compare("opt", [replicas[0], replicas[3]])
    assert [d.entry for d in lr.differences] == ["param_groups[0]['lr']"]
    assert lr.differences[0].max_abs_diff == pytest.approx(0.1)


def test_long_lists_of_differences_are_cut_after_ten():
    result = compare("v", [flatten(list(range(13))), flatten([i + 1 for i in range(13)])])
    lines = repr(result).splitlines()
    assert lines[0] == "v: differs across 2 ranks in 13 of 13 entries, max |diff| 1.0e+00"
    assert lines[2] == "  v[0]   1      max |diff| 1.0e+00"
    assert len(lines) == 2 + 10 + 1 and lines[-1] == "  ... and 3 more"
    page = result._repr_html_()
    assert page.count("<tr><td>") == 10 and "<p>... and 3 more</p>" in page


def test_html_escapes_entry_names():
    page = compare("d", [flatten({"<b>": 1}), flatten({"<b>": 2})])._repr_html_()
    assert "<code>d[&#x27;&lt;b&gt;&#x27;]</code>" in page
    assert page.startswith("<p><b>d: differs across 2 ranks in 1 of 1 entry, max |diff| 1.0e+00")


def test_single_rank_and_no_ranks():
    assert repr(compare("x", [flatten(3)])) == "x: identical on 1 rank (1 entry)"
    with pytest.raises(ValueError, match=r"^compare 'x': no rank sent its entries"):
        compare("x", [])


def namespace(**values):
    return [describe(name, value) for name, value in values.items()]


def test_vars_table_rows_and_text():
    fn = len
    per_rank = [
        namespace(x=3, model=linear(), f=fn, only0=1.5, t=torch.zeros(2, 3)),
        namespace(x=3, model=nudged(), f=fn, t=torch.zeros(2, 3)),
    ]
    table = vars_table(per_rank)
    assert table.world_size == 2
    assert table.rows == (
        VarsRow("f", "builtin_function_or_method", None, None, None, None, "not compared"),
        VarsRow("model", "Linear", None, "float32", "cpu", 15, "no (differs on rank 1)"),
        VarsRow("only0", "float", None, None, None, None, "only on rank 0"),
        VarsRow("t", "Tensor", (2, 3), "float32", "cpu", None, "yes"),
        VarsRow("x", "int", None, None, None, None, "yes"),
    )
    assert repr(table).splitlines() == [
        "name   type                        shape   dtype    device  params  same on every rank",
        "f      builtin_function_or_method                                   not compared",
        "model  Linear                              float32  cpu     15      "
        "no (differs on rank 1)",
        "only0  float                                                        only on rank 0",
        "t      Tensor                      (2, 3)  float32  cpu             yes",
        "x      int                                                          yes",
    ]
    page = table._repr_html_()
    assert page.count("<tr>") == 6
    assert "<td>no (differs on rank 1)</td>" in page


def test_vars_table_when_types_differ_or_a_rank_holds_the_only_copy():
    table = vars_table([namespace(a=[1, 2]), namespace(a=(1, 2), b=1), namespace(a=[1, 2])])
    assert [(r.name, r.type, r.same) for r in table.rows] == [
        ("a", "list", "no (differs on rank 1)"),
        ("b", "int", "only on rank 1"),
    ]


def test_vars_table_params_use_thousands_separators():
    torch.manual_seed(0)
    table = vars_table([namespace(big=nn.Linear(100, 100))])
    assert table.rows[0].params == 10100
    assert "10,100" in repr(table)


def test_empty_vars_table():
    assert repr(vars_table([[], []])) == "no variables on the workers"
    assert vars_table([[]])._repr_html_() == "<p>no variables on the workers</p>"
