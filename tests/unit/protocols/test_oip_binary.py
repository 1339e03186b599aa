"""OIP's binary tensor extension: tensors to and from raw bytes, requests in, responses out."""

from __future__ import annotations

import math
import struct
from typing import Any

import orjson
import pytest

from modelyard.errors import MalformedBody
from modelyard.protocols import oip

ROUND_TRIPS = [
    ("BOOL", [True, False, True]),
    ("INT8", [-128, 0, 127]),
    ("INT16", [-32768, 1, 32767]),
    ("INT32", [-(2**31), 7, 2**31 - 1]),
    ("INT64", [-(2**63), 7, 2**63 - 1]),
    ("UINT8", [0, 1, 255]),
    ("UINT16", [0, 1, 65535]),
    ("UINT32", [0, 1, 2**32 - 1]),
    ("UINT64", [0, 1, 2**64 - 1]),
    ("FP16", [0.5, -2.0, 65504.0]),
    ("FP32", [0.25, -1.5, 2.0**127]),
    ("FP64", [0.1, -1e300, 5e-324]),
    ("BF16", [1.0, -2.5, 2.0**127]),
    ("BYTES", [b"", b"\xff\x00\x80", "hé".encode()]),
]


@pytest.mark.parametrize(("datatype", "data"), ROUND_TRIPS)
def test_round_trip(datatype: str, data: list[Any]) -> None:
    raw = oip.tensor_to_bytes(data, datatype)
    assert oip.tensor_from_bytes(raw, datatype, len(data)) == data


def test_layout_is_little_endian_and_bytes_are_length_prefixed() -> None:
    assert oip.tensor_to_bytes([1, 2], "INT32") == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert oip.tensor_to_bytes([True, False], "BOOL") == b"\x01\x00"
    assert oip.tensor_to_bytes([1.0], "FP16") == struct.pack("<e", 1.0)
    assert oip.tensor_to_bytes([1.0], "BF16") == b"\x80\x3f"
    assert oip.tensor_to_bytes(["ab", b"c"], "BYTES") == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"


def test_floats_beyond_the_range_become_infinity_and_bf16_rounds_to_nearest() -> None:
    assert oip.tensor_from_bytes(oip.tensor_to_bytes([1e6, -1e6], "FP16"), "FP16", 2) == [math.inf, -math.inf]
    assert oip.tensor_from_bytes(oip.tensor_to_bytes([1e300], "FP32"), "FP32", 1) == [math.inf]
    ties = [1.00390625, 1.01171875]  # halfway between two BF16 values: to the even one
    assert oip.tensor_from_bytes(oip.tensor_to_bytes(ties, "BF16"), "BF16", 2) == [1.0, 1.015625]
    assert math.isnan(oip.tensor_from_bytes(oip.tensor_to_bytes([math.nan], "BF16"), "BF16", 1)[0])


@pytest.mark.parametrize(
    ("raw", "datatype", "count", "message"),
    [
        (b"\x00" * 7, "FP32", 2, "7 bytes of binary data, 8 expected"),
        (b"\x00" * 9, "FP32", 2, "9 bytes of binary data, 8 expected"),
        (b"\x00" * 2, "FP99", 1, "unknown datatype"),
        (b"\x01\x00\x00\x00a", "BYTES", 2, "1 BYTES elements, 2 expected"),
        (b"\x01\x00\x00\x00ab", "BYTES", 1, "1 bytes after the last of 1 BYTES elements"),
        (b"\x05\x00\x00\x00ab", "BYTES", 1, "runs past the data"),
        (b"\x01\x00", "BYTES", 1, "length is cut off"),
    ],
)
def test_bad_tensor_bytes(raw: bytes, datatype: str, count: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        oip.tensor_from_bytes(raw, datatype, count)


def test_integral_floats_and_0_or_1_booleans_are_taken() -> None:
    assert oip.tensor_to_bytes([6.0, -1.0], "INT64") == struct.pack("<2q", 6, -1)
    assert oip.tensor_to_bytes([1, 0, True], "BOOL") == b"\x01\x00\x01"


@pytest.mark.parametrize(
    ("data", "datatype", "message"),
    [
        ([128], "INT8", "INT8 data does not fit"),
        ([-1], "UINT32", "UINT32"),
        ([1.5], "INT64", "INT64"),
        ([1], "BYTES", "strings or bytes"),
        (["x"], "FP32", "FP32 data does not fit"),
        (["no"], "BOOL", "BOOL data does not fit: 'no' is not a BOOL"),
        ([2], "BOOL", "is not a BOOL"),
        ([None], "BYTES", "strings or bytes"),
        ([None], "INT32", "INT32 data does not fit"),
        ([None], "FP32", "FP32 data does not fit"),
    ],
)
def test_data_that_does_not_fit_the_datatype(data: list[Any], datatype: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        oip.tensor_to_bytes(data, datatype)


# Requests


def binary_request(
    inputs: list[tuple[str, str, list[int], bytes]], **fields: Any
) -> tuple[bytes, dict[str, str]]:
    """A request whose inputs are all binary: (name, datatype, shape, raw bytes) each."""
    tensors = [
        {"name": n, "datatype": t, "shape": s, "parameters": {"binary_data_size": len(raw)}}
        for n, t, s, raw in inputs
    ]
    head = orjson.dumps({"inputs": tensors, **fields})
    return head + b"".join(raw for *_, raw in inputs), {oip.BINARY_HEADER: str(len(head))}


def test_read_request_decodes_binary_inputs_in_order_beside_json_ones() -> None:
    head = {
        "id": "r1",
        "inputs": [
            {"name": "a", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
            {"name": "j", "datatype": "INT64", "shape": [1], "data": [5]},
            {"name": "s", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6, "k": 1}},
        ],
    }
    raw = orjson.dumps(head)
    body = raw + struct.pack("<2f", 1.5, -2.0) + b"\x02\x00\x00\x00hi"
    request = oip.read_infer_request(body, {oip.BINARY_HEADER: str(len(raw))})
    assert request["id"] == "r1"
    assert request["inputs"] == [
        {"name": "a", "datatype": "FP32", "shape": [2], "data": [1.5, -2.0]},
        {"name": "j", "datatype": "INT64", "shape": [1], "data": [5]},
        {"name": "s", "datatype": "BYTES", "shape": [1], "parameters": {"k": 1}, "data": [b"hi"]},
    ]


def test_read_request_without_the_header_is_plain_json() -> None:
    body = orjson.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1.0]}]})
    assert oip.read_infer_request(body, {})["inputs"][0]["data"] == [1.0]


def _bad(body: bytes, headers: dict[str, str], message: str) -> None:
    with pytest.raises(MalformedBody, match=message) as info:
        oip.read_infer_request(body, headers)
    assert info.value.status == 400
    if headers:  # routing (the gateway) reads the JSON header and the sizes, not the tensors
        if "expected" in message or "shape" in message or "datatype" in message:
            oip.routing_request("m", body, headers, affinity_chars=10)
        else:
            with pytest.raises(MalformedBody, match=message):
                oip.routing_request("m", body, headers, affinity_chars=10)


def test_header_length_beyond_the_body() -> None:
    body, _ = binary_request([("a", "FP32", [1], b"\x00" * 4)])
    _bad(body, {oip.BINARY_HEADER: str(len(body) + 1)}, "is .* but the body has")
    _bad(body, {oip.BINARY_HEADER: "0"}, "is 0 but the body has")

    # Plain ASCII digits only: int() would take each of these.
    for value in ("-4", "+5", " 5", "5 ", "1_0", "\u0665", "0x5"):
        _bad(body, {oip.BINARY_HEADER: value}, "must be a non-negative decimal integer")


def test_size_not_matching_shape_and_datatype() -> None:
    body, headers = binary_request([("a", "FP32", [2], b"\x00" * 4)])
    _bad(body, headers, r"input 'a' \(shape \[2\], FP32\): 4 bytes of binary data, 8 expected")


def test_size_running_past_the_body_or_leaving_trailing_bytes() -> None:
    body, headers = binary_request([("a", "FP32", [1], b"\x00" * 4)])
    _bad(body[:-1], headers, "input 'a': binary_data_size 4 runs past the end of the body")
    _bad(body + b"xx", headers, "2 bytes after the JSON header are not claimed")


def test_missing_or_bad_binary_data_size() -> None:
    head = orjson.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]})
    _bad(head + b"\x00" * 4, {oip.BINARY_HEADER: str(len(head))}, "4 bytes after the JSON header")
    for size in ("4", -1, True):
        tensor = {"name": "a", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": size}}
        head = orjson.dumps({"inputs": [tensor]})
        _bad(
            head + b"\x00" * 4, {oip.BINARY_HEADER: str(len(head))}, "binary_data_size must be a non-negative"
        )


def test_binary_size_without_the_header_and_both_data_and_size() -> None:
    tensor = {"name": "a", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}
    _bad(
        orjson.dumps({"inputs": [tensor]}),
        {},
        f"input 'a' has parameters.binary_data_size but .*{oip.BINARY_HEADER}",
    )
    head = orjson.dumps({"inputs": [{**tensor, "data": [1.0]}]})
    _bad(
        head + b"\x00" * 4, {oip.BINARY_HEADER: str(len(head))}, "both 'data' and parameters.binary_data_size"
    )


def test_bad_shape_or_datatype_of_a_binary_input() -> None:
    body, headers = binary_request([("a", "FP99", [1], b"\x00" * 4)])
    _bad(body, headers, "input 'a': unknown datatype 'FP99'")
    body, headers = binary_request([("a", "FP32", [-1], b"\x00" * 4)])
    _bad(body, headers, "input 'a': shape must be a list of non-negative integers")


# Responses

RESPONSE = {
    "model_name": "m",
    "outputs": [
        {"name": "f", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]},
        {"name": "s", "datatype": "BYTES", "shape": [1], "data": [b"hi"]},
    ],
}


def test_response_stays_json_unless_asked() -> None:
    body, length = oip.write_infer_response(RESPONSE, {"inputs": []})
    assert length is None
    assert orjson.loads(body)["outputs"][1]["data"] == ["hi"]


def test_binary_output_per_output_and_for_all() -> None:
    request = {"outputs": [{"name": "f", "parameters": {"binary_data": True}}, {"name": "s"}]}
    body, length = oip.write_infer_response(RESPONSE, request)
    assert length is not None
    head = orjson.loads(body[:length])
    assert head["model_name"] == "m"
    f, s = head["outputs"]
    assert f == {"name": "f", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}
    assert s["data"] == ["hi"]
    assert body[length:] == struct.pack("<2f", 1.0, 2.0)

    everything = {
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "f", "parameters": {"binary_data": False}}],
    }
    body, length = oip.write_infer_response(RESPONSE, everything)
    assert length is not None
    f, s = orjson.loads(body[:length])["outputs"]
    assert f["data"] == [1.0, 2.0]
    assert s["parameters"] == {"binary_data_size": 6}
    assert body[length:] == b"\x02\x00\x00\x00hi"


def test_response_output_that_cannot_be_encoded_names_it() -> None:
    response = {"outputs": [{"name": "s", "datatype": "BYTES", "shape": [1], "data": [b"\xff"]}]}
    with pytest.raises(ValueError, match="output 's': BYTES data is not valid UTF-8"):
        oip.write_infer_response(response, {})
    response = {"outputs": [{"name": "i", "datatype": "INT8", "shape": [1], "data": [300]}]}
    with pytest.raises(ValueError, match="output 'i': INT8 data does not fit"):
        oip.write_infer_response(response, {"parameters": {"binary_data_output": True}})


def test_routing_a_json_body_does_not_walk_its_inputs() -> None:
    # Without the header the body is plain JSON (KServe v1 too): the server judges its inputs.
    tensor = {"name": "a", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}
    raw = orjson.dumps({"inputs": [tensor]})
    assert oip.routing_request("m", raw, {}, affinity_chars=10).fields == {"inputs": [tensor]}
