import pytest

from modelyard.simworker.tensors import oip_outputs, scale_nested


def tensor(name, datatype, shape, data):
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def test_scale_one_echoes_every_input():
    body = {"inputs": [tensor("a", "FP32", [2], [1.5, 2]), tensor("b", "BYTES", [1], ["x"])]}
    out = oip_outputs(body, 1.0)
    assert out == [tensor("a", "FP32", [2], [1.5, 2.0]), tensor("b", "BYTES", [1], ["x"])]


def test_integral_scale_keeps_ints_and_flattens():
    out = oip_outputs({"inputs": [tensor("i", "INT64", [2, 2], [[1, 2], [3, 4]])]}, 3.0)
    assert out == [tensor("i", "INT64", [2, 2], [3, 6, 9, 12])]
    assert all(isinstance(x, int) for x in out[0]["data"])


def test_fractional_scale_turns_ints_into_fp64():
    out = oip_outputs({"inputs": [tensor("i", "UINT8", [2], [1, 3])]}, 0.5)
    assert out == [tensor("i", "FP64", [2], [0.5, 1.5])]


def test_bool_and_bytes_are_echoed():
    body = {"inputs": [tensor("b", "BOOL", [2], [True, False]), tensor("s", "BYTES", [1], ["hi"])]}
    assert [o["data"] for o in oip_outputs(body, 2.0)] == [[True, False], ["hi"]]


def test_outputs_filter_selects_and_orders():
    body = {
        "inputs": [tensor("a", "FP32", [1], [1.0]), tensor("b", "FP32", [1], [2.0])],
        "outputs": [{"name": "b"}],
    }
    assert [o["name"] for o in oip_outputs(body, 1.0)] == ["b"]
    body["outputs"] = [{"name": "zzz"}]
    with pytest.raises(ValueError, match="zzz"):
        oip_outputs(body, 1.0)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"inputs": []},
        {"inputs": "x"},
        {"inputs": [tensor("a", "FP32", [3], [1.0, 2.0])]},
        {"inputs": [tensor("a", "FP99", [1], [1.0])]},
        {"inputs": [tensor("a", {}, [1], [1.0])]},  # found by the schemathesis run: was a TypeError (500)
        {"inputs": [tensor("a", ["FP32"], [1], [1.0])]},
        {"inputs": [tensor("a", "FP32", [1], ["x"])]},
        {"inputs": [tensor("a", "INT32", [1], [1.5])]},
        {"inputs": [tensor("a", "FP32", [-1], [1.0])]},
        {"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]},
        {"inputs": [tensor("", "FP32", [1], [1.0])]},
    ],
)
def test_bad_inputs_raise(body):
    with pytest.raises(ValueError):
        oip_outputs(body, 1.0)


def test_scale_nested_keeps_structure():
    instances = [[1, 2.5, "s", True, None], {"k": [2]}]
    assert scale_nested(instances, 2.0) == [[2, 5.0, "s", True, None], {"k": [4]}]
    assert scale_nested([3], 0.5) == [1.5]


def test_scale_nested_bounds_depth():
    deep: list = [1]
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ValueError):
        scale_nested(deep, 1.0)
