"""The engine side of ``%distrain vars`` / ``compare``: flattening values and describing them."""

import collections
import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from nbdist.engine.inspect import describe, flatten
from nbdist.kernel.compare import compare

COMPARABLE = (
    "compare numbers, strings, tensors, arrays, lists/tuples/dicts of them, nn.Module, "
    "Keras models or optimizers; or compare an attribute of it"
)


def linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def test_plain_containers_flatten_to_subscript_paths():
    value = {"lr": 0.1, "steps": [1, 2], "name": "run", "done": True, "none": None, 3: (b"x",)}
    assert flatten(value) == {
        "['lr']": 0.1,
        "['steps'][0]": 1,
        "['steps'][1]": 2,
        "['name']": "run",
        "['done']": True,
        "['none']": None,
        "[3][0]": b"x",
    }


def test_a_leaf_is_its_own_entry_and_numpy_scalars_become_python_numbers():
    assert flatten(3) == {"": 3}
    out = flatten(np.float32(1.5))
    assert out == {"": 1.5} and type(out[""]) is float


def test_namedtuple_fields_are_named():
    Point = collections.namedtuple("Point", "x y")
    assert flatten(Point(1, [2.0])) == {"x": 1, "y[0]": 2.0}


def test_tensors_become_detached_cpu_arrays_keeping_dtype():
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3).requires_grad_()
    ((path, array),) = flatten({"t": t}).items()
    assert path == "['t']"
    assert isinstance(array, np.ndarray) and array.dtype == np.float64 and array.shape == (2, 3)
    np.testing.assert_array_equal(array, np.arange(6.0).reshape(2, 3))


def test_bfloat16_comes_back_as_float32_with_the_same_values():
    out = flatten(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))[""]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [1.5, -2.0])


def test_module_flattens_to_its_state_dict():
    model = nn.Sequential(linear(), nn.BatchNorm1d(3))
    out = flatten(model)
    assert list(out) == [
        "0.weight", "0.bias", "1.weight", "1.bias",
        "1.running_mean", "1.running_var", "1.num_batches_tracked",
    ]  # fmt: skip
    np.testing.assert_array_equal(out["0.weight"], model[0].weight.detach().numpy())
    assert out["1.num_batches_tracked"].dtype == np.int64


def test_optimizer_flattens_to_per_param_state_and_hyperparameters():
    model = linear()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    out = flatten(opt)
    assert out["param_groups[0]['lr']"] == 0.1
    assert out["param_groups[0]['betas'][0]"] == 0.9
    assert out["param_groups[0]['params'][1]"] == 1
    assert out["state[0]['step']"] == np.float32(1.0)
    assert out["state[0]['exp_avg']"].shape == (3, 4)
    np.testing.assert_allclose(out["state[1]['exp_avg']"], 0.1 * 2 * np.ones(3), rtol=1e-6)


def test_torch_device_and_dtype_compare_as_strings():
    assert flatten({"device": torch.device("cpu"), "dtype": torch.float16}) == {
        "['device']": "cpu",
        "['dtype']": "torch.float16",
    }


def test_unsupported_object_raises_typeerror_naming_what_compares():
    class Foo:
        pass

    with pytest.raises(TypeError) as err:
        flatten(Foo())
    assert str(err.value) == f"cannot compare a Foo: {COMPARABLE}"
    with pytest.raises(TypeError) as err:
        flatten({"a": [1, object()]})
    assert str(err.value) == f"cannot compare an object at ['a'][1]: {COMPARABLE}"


def test_object_arrays_and_cycles_raise_typeerror():
    with pytest.raises(TypeError, match=r"^cannot compare an object array at \[0\]: compare"):
        flatten([np.array([None, 1], dtype=object)])
    loop = [1]
    loop.append(loop)
    with pytest.raises(TypeError, match=r"^cannot compare a list that contains itself at \[1\]$"):
        flatten(loop)


def test_describe_a_number_and_a_tensor():
    row = describe("x", 3)
    assert row == {
        "name": "x", "type": "int", "shape": None, "dtype": None, "device": None,
        "params": None, "digest": row["digest"], "comparable": True,
    }  # fmt: skip
    assert len(row["digest"]) == 16
    row = describe("t", torch.zeros(2, 5, dtype=torch.float16))
    assert {k: row[k] for k in ("type", "shape", "dtype", "device", "params", "comparable")} == {
        "type": "Tensor", "shape": (2, 5), "dtype": "float16", "device": "cpu",
        "params": None, "comparable": True,
    }  # fmt: skip
    row = describe("a", np.zeros((3,), dtype=np.int32))
    facts = (row["type"], row["shape"], row["dtype"], row["device"])
    assert facts == ("ndarray", (3,), "int32", None)


def test_describe_a_module_gives_its_parameter_count():
    model = nn.Sequential(linear(), nn.BatchNorm1d(3))
    row = describe("model", model)
    # 4*3 + 3 (Linear) + 3 + 3 (BatchNorm affine); running stats are buffers, not parameters.
    assert (row["type"], row["params"], row["dtype"], row["device"]) == (
        "Sequential", 21, "float32", "cpu",
    )  # fmt: skip
    assert row["shape"] is None and row["comparable"] is True


def test_describe_what_does_not_flatten_hashes_its_type_name_only():
    row = describe("f", lambda: 1)
    assert row["type"] == "function" and row["comparable"] is False
    assert row["digest"] == hashlib.blake2b(b"function", digest_size=8).hexdigest()
    assert describe("g", print)["comparable"] is False


def test_describe_a_lazy_module_has_no_parameter_count_yet():
    row = describe("lazy", nn.LazyLinear(3))
    assert row["type"] == "LazyLinear" and row["params"] is None


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (lambda: linear(0), lambda: linear(0), True),
        (lambda: linear(0), lambda: linear(1), False),
        (lambda: {"a": 1, "b": 2}, lambda: {"b": 2, "a": 1}, True),  # dict order does not matter
        (lambda: [1, 2], lambda: [1, 3], False),
        (lambda: 1, lambda: 1.0, False),  # compare reports int vs float
        (lambda: -0.0, lambda: 0.0, True),
        (lambda: np.array([np.nan, -0.0]), lambda: np.array([np.nan, 0.0]), True),
        (lambda: np.zeros(4), lambda: np.zeros((2, 2)), False),
        (lambda: np.zeros(4), lambda: np.zeros(4, dtype=np.float32), False),
        (lambda: "a", lambda: "b", False),
    ],
)
def test_digest_equal_iff_compare_finds_the_values_identical(a, b, equal):
    va, vb = a(), b()
    assert (describe("v", va)["digest"] == describe("v", vb)["digest"]) is equal
    assert compare("v", [flatten(va), flatten(vb)]).identical is equal


def test_digest_sees_a_nudged_weight():
    a, b = linear(), linear()
    with torch.no_grad():
        b.weight[0, 0] += 1e-3
    assert describe("m", a)["digest"] != describe("m", b)["digest"]


def test_ddp_flattens_under_its_module_prefix(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ddp = nn.parallel.DistributedDataParallel(linear())
        row = describe("model", ddp)
        assert list(flatten(ddp)) == ["module.weight", "module.bias"]
    finally:
        dist.destroy_process_group()
    assert (row["type"], row["params"], row["comparable"]) == ("DistributedDataParallel", 15, True)


def test_describing_a_number_imports_no_framework():
    code = (
        "import sys; from nbdist.engine.inspect import describe; describe('x', 3);"
        "describe('y', [1.0, {'a': 'b'}]); describe('f', len);"
        "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.tf
def test_keras_model_and_tf_values():
    keras = pytest.importorskip("keras")
    tf = pytest.importorskip("tensorflow")

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
        return model

    a, b = build(), build()
    row = describe("model", a)
    assert (row["type"], row["params"], row["comparable"]) == ("Sequential", 15, True)
    out = flatten(a)
    assert {k: v.shape for k, v in out.items()} == {"dense/kernel": (4, 3), "dense/bias": (3,)}
    assert compare("model", [out, flatten(b)]).identical
    b.layers[0].kernel.assign(b.layers[0].kernel + 1e-3)
    result = compare("model", [out, flatten(b)])
    assert [d.entry for d in result.differences] == ["dense/kernel"]
    assert result.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert describe("model", a)["digest"] != describe("model", b)["digest"]

    opt = keras.optimizers.Adam(0.01)
    opt.build(a.trainable_variables)
    assert list(flatten(opt))[:2] == ["iteration", "learning_rate"]
    assert flatten(opt)["learning_rate"] == np.float32(0.01)

    v = tf.Variable([[1.0, 2.0]])
    assert describe("v", v)["shape"] == (1, 2) and describe("v", v)["dtype"] == "float32"
    np.testing.assert_array_equal(flatten({"v": v, "t": tf.constant(3)})["['v']"], [[1.0, 2.0]])
    assert flatten(tf.constant(3))[""] == np.int32(3)
