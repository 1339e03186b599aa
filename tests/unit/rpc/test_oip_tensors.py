"""OIP v2's gRPC messages to and from its REST JSON (rpc/oip_tensors.py)."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest

from modelyard.errors import BadRequest, PayloadTooLarge, UpstreamError
from modelyard.protocols import oip
from modelyard.rpc import oip_tensors
from modelyard.rpc.oip_tensors import infer_request_json, infer_response, model_metadata
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb

BIG = 1 << 30


def _request(*tensors: tuple[str, str, list[int]], raw: list[bytes] | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", raw_input_contents=raw or [])
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def test_raw_inputs_are_decoded_little_endian():
    raw = [
        struct.pack("<4f", 1.0, 2.5, -3.0, 4.0),
        struct.pack("<2q", -1, 2**40),
        struct.pack("<3?", True, False, True),
        struct.pack("<2e", 0.5, -2.0),
        struct.pack("<I", 2) + b"hi" + struct.pack("<I", 0),
    ]
    request = _request(
        ("a", "FP32", [2, 2]),
        ("b", "INT64", [2]),
        ("c", "BOOL", [3]),
        ("d", "FP16", [2]),
        ("e", "BYTES", [2]),
        raw=raw,
    )
    request.id = "r1"
    request.parameters["priority"].int64_param = 3
    request.parameters["binary_data_output"].bool_param = True  # the REST hop is JSON: dropped
    body = infer_request_json(request, max_json_bytes=BIG)
    assert body["id"] == "r1"
    assert body["parameters"] == {"priority": 3}
    assert [(i["name"], i["shape"], i["datatype"], i["data"]) for i in body["inputs"]] == [
        ("a", [2, 2], "FP32", [1.0, 2.5, -3.0, 4.0]),
        ("b", [2], "INT64", [-1, 2**40]),
        ("c", [3], "BOOL", [True, False, True]),
        ("d", [2], "FP16", [0.5, -2.0]),
        ("e", [2], "BYTES", ["hi", ""]),
    ]


def test_typed_contents_are_read_by_datatype():
    request = _request(("a", "INT32", [2]), ("b", "BYTES", [1]), ("c", "UINT64", [1]))
    request.inputs[0].contents.int_contents.extend([7, -8])
    request.inputs[1].contents.bytes_contents.append("é".encode())
    request.inputs[2].contents.uint64_contents.append(2**63)
    request.outputs.add(name="a")
    body = infer_request_json(request, max_json_bytes=BIG)
    assert [i["data"] for i in body["inputs"]] == [[7, -8], ["é"], [2**63]]
    assert body["outputs"] == [{"name": "a"}]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (_request(("a", "FP32", [2]), raw=[b"\0" * 4]), "4 raw bytes do not hold 2 FP32 elements"),
        (_request(("a", "FP32", [1]), ("b", "FP32", [1]), raw=[b"\0" * 4]), "send every input raw or none"),
        (_request(("a", "FP16", [1])), "FP16 data must be sent in raw_input_contents"),
        (_request(("a", "COMPLEX", [1]), raw=[b""]), "unknown datatype 'COMPLEX'"),
        (_request(("a", "FP32", [2])), "0 elements in contents.fp32_contents do not fill its shape (2)"),
        (_request(("a", "BYTES", [1]), raw=[struct.pack("<I", 5) + b"ab"]), "runs past the data"),
        (_request(("a", "BYTES", [1]), raw=[struct.pack("<I", 1) + b"\xff"]), "not UTF-8"),
        (_request(("a", "FP32", [-1]), raw=[b""]), "negative dimension"),
    ],
)
def test_bad_inputs_are_bad_requests(request_, message):
    with pytest.raises(BadRequest) as refused:
        infer_request_json(request_, max_json_bytes=BIG)
    assert message in refused.value.message


def test_outputs_are_answered_raw():
    body = {
        "model_name": "m",
        "model_version": "2",
        "id": "r1",
        "parameters": {"cached": True, "big": 2**63, "huge": 2**64, "note": "x", "ratio": 0.5},
        "outputs": [
            {"name": "a", "datatype": "FP32", "shape": [2, 1], "data": [[1.5], [2.0]]},
            {"name": "b", "datatype": "INT64", "shape": [1], "data": [6.0]},
            {"name": "c", "datatype": "BYTES", "shape": [1], "data": ["ok"]},
            {"name": "d", "datatype": "BF16", "shape": [1], "data": [1.0]},
        ],
    }
    response = infer_response(body, "m", "")
    assert (response.model_name, response.model_version, response.id) == ("m", "2", "r1")
    assert response.parameters["cached"].bool_param is True
    assert response.parameters["big"].uint64_param == 2**63
    assert "huge" not in response.parameters  # no InferParameter holds it
    assert (response.parameters["note"].string_param, response.parameters["ratio"].double_param) == ("x", 0.5)
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("a", "FP32", [2, 1]),
        ("b", "INT64", [1]),
        ("c", "BYTES", [1]),
        ("d", "BF16", [1]),
    ]
    assert list(response.raw_output_contents) == [
        struct.pack("<2f", 1.5, 2.0),
        struct.pack("<q", 6),
        struct.pack("<I", 2) + b"ok",
        struct.pack("<H", 0x3F80),
    ]


def test_a_malformed_server_answer_is_an_upstream_error():
    with pytest.raises(UpstreamError):
        infer_response(["not", "a", "response"], "m", "")
    with pytest.raises(UpstreamError, match="not valid INT32 data"):
        infer_response(
            {"outputs": [{"name": "a", "datatype": "INT32", "shape": [1], "data": [1.5]}]}, "m", ""
        )


def test_model_metadata():
    body = {
        "name": "m",
        "versions": ["1"],
        "platform": "p",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
    }
    metadata = model_metadata(body, "m")
    assert (metadata.name, list(metadata.versions), metadata.platform) == ("m", ["1"], "p")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("x", "FP32", [-1, 3])]
    with pytest.raises(UpstreamError):
        model_metadata({"inputs": [{"shape": ["x"]}]}, "m")


@pytest.mark.parametrize(
    ("datatype", "raw"),
    [
        ("FP32", struct.pack("<2f", 1.0, math.nan)),
        ("FP64", struct.pack("<2d", math.inf, 0.0)),
        ("FP16", struct.pack("<2e", -math.inf, 0.0)),
        ("BF16", struct.pack("<2H", 0x3F80, 0x7FC0)),  # 1.0, NaN
    ],
)
def test_non_finite_inputs_are_refused(datatype: str, raw: bytes):
    # JSON has no NaN or infinity: orjson would write null, and the model would see None.
    with pytest.raises(BadRequest, match=f"input 'a': {datatype} data holds NaN or infinity"):
        infer_request_json(_request(("a", datatype, [2]), raw=[raw]), max_json_bytes=BIG)


def test_non_finite_typed_contents_are_refused():
    request = _request(("a", "FP64", [1]))
    request.inputs[0].contents.fp64_contents.append(math.nan)
    with pytest.raises(BadRequest, match="NaN or infinity"):
        infer_request_json(request, max_json_bytes=BIG)


@pytest.mark.parametrize(
    ("datatype", "width"),
    [("FP32", 25), ("FP16", 25), ("INT64", 21), ("INT32", 12), ("UINT8", 4), ("BOOL", 6)],
)
def test_inputs_are_bounded_by_their_widest_json(datatype: str, width: int):
    size = {"FP32": 4, "FP16": 2, "INT64": 8, "INT32": 4, "UINT8": 1, "BOOL": 1}[datatype]
    request = _request(("a", datatype, [10]), raw=[b"\0" * (10 * size)])
    assert len(infer_request_json(request, max_json_bytes=10 * width)["inputs"][0]["data"]) == 10
    with pytest.raises(PayloadTooLarge, match=f"up to {10 * width} bytes") as refused:
        infer_request_json(request, max_json_bytes=10 * width - 1)
    assert refused.value.status == 413


def test_bytes_inputs_are_bounded_by_their_escaped_length():
    element = struct.pack("<I", 4) + b"\x01\x02\x03\x04"  # control characters: 6 bytes each in JSON
    request = _request(("a", "BYTES", [2]), raw=[element * 2])
    bound = 2 * 3 + 6 * 16  # quotes and comma per element; 6 per byte, length prefixes included
    assert infer_request_json(request, max_json_bytes=bound)["inputs"][0]["data"] == ["\x01\x02\x03\x04"] * 2
    with pytest.raises(PayloadTooLarge):
        infer_request_json(request, max_json_bytes=bound - 1)
    typed = _request(("a", "BYTES", [1]))
    typed.inputs[0].contents.bytes_contents.append(b"x" * 100)
    with pytest.raises(PayloadTooLarge):
        infer_request_json(typed, max_json_bytes=600)


def test_the_bound_is_checked_before_anything_is_decoded(monkeypatch):
    decoded: list[str] = []
    monkeypatch.setattr(oip_tensors, "tensor_from_bytes", lambda *a: decoded.append(a[1]) or [])
    # The second input alone is over the bound: the first is never decoded.
    request = _request(("a", "FP32", [1]), ("b", "FP64", [1000]), raw=[b"\0" * 4, b"\0" * 8000])
    with pytest.raises(PayloadTooLarge):
        infer_request_json(request, max_json_bytes=10_000)
    assert decoded == []


def _output(datatype: str, shape: Any, data: Any = None) -> dict[str, Any]:
    output: dict[str, Any] = {"name": "y", "datatype": datatype, "shape": shape}
    if data is not None:
        output["data"] = data
    return {"outputs": [output]}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_output("FP32", [4], [1.0]), "output 'y' has 1 elements for shape [4] (4 elements)"),
        (_output("INT32", [2]), "output 'y' has 0 elements for shape [2]"),
        (_output("INT32", [1], [1, 2]), "has 2 elements for shape [1]"),
        (_output("INT32", [2**63], [1]), "shape of non-negative 64-bit integers"),
        (_output("INT32", [-1], [1]), "shape of non-negative 64-bit integers"),
        (_output("BYTES", [1], [None]), "not valid BYTES data"),
        (_output("BOOL", [1], ["no"]), "not valid BOOL data"),
        (_output("INT32", [1], [None]), "not valid INT32 data"),
    ],
)
def test_outputs_that_do_not_fit_their_shape_or_datatype_are_upstream_errors(body, message):
    with pytest.raises(UpstreamError) as refused:
        infer_response(body, "m", "")
    assert message in refused.value.message


def test_outputs_are_encoded_as_the_http_binary_extension_encodes_them():
    # One codec (protocols/oip.py) for both: BF16 rounds to nearest, a float beyond FP16's or
    # FP32's range becomes infinity (as numpy casts it), an integral float fits an integer type.
    body = {
        "outputs": [
            {"name": "a", "datatype": "BF16", "shape": [1], "data": [1.00390625]},  # halfway: to even
            {"name": "b", "datatype": "BF16", "shape": [1], "data": [1.01171875]},  # a tie: to even, up
            {"name": "c", "datatype": "FP16", "shape": [1], "data": [1e6]},
            {"name": "d", "datatype": "FP32", "shape": [1], "data": [-1e300]},
            {"name": "e", "datatype": "UINT8", "shape": [0], "data": []},
        ]
    }
    raws = list(infer_response(body, "m", "").raw_output_contents)
    assert raws == [
        oip.tensor_to_bytes([1.00390625], "BF16"),
        oip.tensor_to_bytes([1.01171875], "BF16"),
        struct.pack("<e", math.inf),
        struct.pack("<f", -math.inf),
        b"",
    ]
    assert raws[:2] == [struct.pack("<H", 0x3F80), struct.pack("<H", 0x3F82)]
