"""OIP v2's gRPC messages to and from its REST JSON (rpc/oip_tensors.py)."""

from __future__ import annotations

import struct

import pytest

from modelyard.errors import BadRequest, UpstreamError
from modelyard.rpc.oip_tensors import infer_request_json, infer_response, model_metadata
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb


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
    body = infer_request_json(request)
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
    body = infer_request_json(request)
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
        (_request(("a", "BYTES", [1]), raw=[struct.pack("<I", 5) + b"ab"]), "shorter than its length"),
        (_request(("a", "BYTES", [1]), raw=[struct.pack("<I", 1) + b"\xff"]), "not UTF-8"),
        (_request(("a", "FP32", [-1]), raw=[b""]), "negative dimension"),
    ],
)
def test_bad_inputs_are_bad_requests(request_, message):
    with pytest.raises(BadRequest) as refused:
        infer_request_json(request_)
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
