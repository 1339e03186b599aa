"""OIP v2 between its gRPC messages and its REST JSON bodies, both ways; pure, no I/O.

A `ModelInferRequest` becomes the JSON body a REST server takes (`inputs[].data` flat, row-major);
tensors that came in `raw_input_contents` (tritonclient.grpc's default) are decoded per datatype
by protocols/oip.py, the codec of the HTTP binary extension: little-endian, a BYTES element as a
4-byte little-endian length and its bytes (JSON carries it as a UTF-8 string). Before anything is
decoded, the JSON the request would become is bounded: its elements times the widest JSON text of
their datatype must fit in `max_json_bytes` (limits.max_body_bytes, as for a REST body). NaN and
infinities are refused: JSON has no way to write them. The JSON answer becomes a
`ModelInferResponse` with every output in `raw_output_contents`, as Triton answers:
tritonclient.grpc's `as_numpy` reads numbers only from there. The binary-data parameters of the
HTTP extension are dropped: the REST hop is plain JSON. Bad input raises `BadRequest` (a request
too big for JSON `PayloadTooLarge`), a malformed server answer `UpstreamError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

from modelyard.errors import BadRequest, PayloadTooLarge, UpstreamError
from modelyard.protocols.oip import BINARY_DATATYPES, ITEM_SIZES, flatten, tensor_from_bytes, tensor_to_bytes
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb

# datatype -> the InferTensorContents field that carries it (FP16 and BF16 travel raw only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
# datatype -> the widest JSON text of one element and its comma: "false,", "-128,",
# "-9223372036854775808,", and a float as orjson writes a double ("-2.2250738585072014e-308,").
_JSON_WIDTHS = {
    "BOOL": 6,
    "INT8": 5,
    "INT16": 7,
    "INT32": 12,
    "INT64": 21,
    "UINT8": 4,
    "UINT16": 6,
    "UINT32": 11,
    "UINT64": 21,
    "FP16": 25,
    "BF16": 25,
    "FP32": 25,
    "FP64": 25,
}
_FLOATS = frozenset({"FP16", "BF16", "FP32", "FP64"})
# A BYTES element in JSON: two quotes and a comma, and at worst 6 characters a byte ("\u001f").
_BYTES_ELEMENT_JSON = 3
_BYTES_BYTE_JSON = 6
_INT64_MAX = 2**63 - 1
_BINARY_PARAMETERS = frozenset({"binary_data", "binary_data_output", "binary_data_size"})


def infer_request_json(request: pb.ModelInferRequest, *, max_json_bytes: int) -> dict[str, Any]:
    """The REST body for `request` (its model and version go in the path, not the body).
    PayloadTooLarge, before any tensor is decoded, when its tensors could take more than
    `max_json_bytes` of JSON."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "send every input raw or none"
        )
    counts = []
    width = 0
    for i, tensor in enumerate(request.inputs):
        count, json_bytes = _sized(tensor, raw[i] if raw else None)
        counts.append(count)
        width += json_bytes
    if width > max_json_bytes:
        raise PayloadTooLarge(
            f"the inputs could take up to {width} bytes as the JSON sent to the model server, over "
            f"limits.max_body_bytes ({max_json_bytes}); send smaller tensors or use the REST API"
        )
    body: dict[str, Any] = {}
    if request.id:
        body["id"] = request.id
    parameters = _parameters_json(request.parameters)
    if parameters:
        body["parameters"] = parameters
    inputs = []
    for i, tensor in enumerate(request.inputs):
        data = _decode_raw(tensor, raw[i], counts[i]) if raw else _from_contents(tensor)
        if tensor.datatype in _FLOATS and not all(map(math.isfinite, data)):
            raise BadRequest(
                f"input {tensor.name!r}: {tensor.datatype} data holds NaN or infinity, which OIP's "
                "JSON (the REST form this call is turned into) cannot carry"
            )
        item: dict[str, Any] = {"name": tensor.name, "shape": list(tensor.shape), "datatype": tensor.datatype}
        item["data"] = data
        parameters = _parameters_json(tensor.parameters)
        if parameters:
            item["parameters"] = parameters
        inputs.append(item)
    body["inputs"] = inputs
    if request.outputs:
        outputs = []
        for output in request.outputs:
            wanted: dict[str, Any] = {"name": output.name}
            parameters = _parameters_json(output.parameters)
            if parameters:
                wanted["parameters"] = parameters
            outputs.append(wanted)
        body["outputs"] = outputs
    return body


def infer_response(body: object, model: str, version: str) -> pb.ModelInferResponse:
    """The gRPC answer for a REST server's JSON infer response."""
    if not isinstance(body, dict) or not isinstance(body.get("outputs", []), list):
        raise UpstreamError(f"model {model!r}: the server's infer response is not an OIP v2 response")
    response = pb.ModelInferResponse(
        model_name=str(body.get("model_name") or model),
        model_version=str(body.get("model_version") or version),
        id=str(body.get("id") or ""),
    )
    _set_parameters(response.parameters, body.get("parameters"))
    for i, output in enumerate(body.get("outputs", [])):
        if not isinstance(output, dict):
            raise UpstreamError(f"model {model!r}: outputs[{i}] of the server's response is not an object")
        name, datatype, shape = output.get("name"), output.get("datatype"), output.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str) or not _is_shape(shape):
            raise UpstreamError(
                f"model {model!r}: outputs[{i}] of the server's response needs a name, a datatype and "
                "a shape of non-negative 64-bit integers"
            )
        try:
            flat = flatten(output.get("data", []))
        except ValueError as exc:
            raise UpstreamError(f"model {model!r}: output {name!r}: {exc}") from None
        if len(flat) != math.prod(shape):
            raise UpstreamError(
                f"model {model!r}: output {name!r} has {len(flat)} elements for shape {shape} "
                f"({math.prod(shape)} elements)"
            )
        try:
            raw = tensor_to_bytes(flat, datatype)
        except ValueError as exc:
            raise UpstreamError(
                f"model {model!r}: output {name!r} is not valid {datatype} data: {exc}"
            ) from None
        tensor = response.outputs.add(name=name, datatype=datatype, shape=shape)
        _set_parameters(tensor.parameters, output.get("parameters"))
        response.raw_output_contents.append(raw)
    return response


def model_metadata(body: object, model: str) -> pb.ModelMetadataResponse:
    """The gRPC answer for a REST server's model metadata (GET /v2/models/{name})."""
    if not isinstance(body, dict):
        raise UpstreamError(f"model {model!r}: the server's model metadata is not a JSON object")
    try:
        return pb.ModelMetadataResponse(
            name=str(body.get("name") or model),
            versions=[str(v) for v in body.get("versions") or []],
            platform=str(body.get("platform") or ""),
            inputs=[_tensor_metadata(t) for t in body.get("inputs") or []],
            outputs=[_tensor_metadata(t) for t in body.get("outputs") or []],
        )
    except (TypeError, ValueError, AttributeError) as exc:
        raise UpstreamError(f"model {model!r}: the server's model metadata is malformed: {exc}") from None


def _tensor_metadata(tensor: Mapping[str, Any]) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(
        name=str(tensor.get("name", "")),
        datatype=str(tensor.get("datatype", "")),
        shape=[int(d) for d in tensor.get("shape") or []],
    )


# --- tensors -----------------------------------------------------------------------------------


def _sized(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> tuple[int, int]:
    """(elements, the most bytes of JSON they can take) of an input, from its shape and sizes alone;
    BadRequest when its shape, datatype or data size cannot be right."""
    name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
    if any(d < 0 for d in shape):
        raise BadRequest(f"input {name!r}: shape {shape} has a negative dimension")
    count = math.prod(shape)
    if datatype not in BINARY_DATATYPES:
        raise BadRequest(f"input {name!r}: unknown datatype {datatype!r}")
    if raw is not None:
        if datatype == "BYTES":
            return count, _BYTES_ELEMENT_JSON * count + _BYTES_BYTE_JSON * len(raw)
        if len(raw) != ITEM_SIZES[datatype] * count:
            raise BadRequest(
                f"input {name!r}: {len(raw)} raw bytes do not hold {count} {datatype} elements "
                f"({ITEM_SIZES[datatype]} bytes each)"
            )
        return count, _JSON_WIDTHS[datatype] * count
    field = _CONTENTS.get(datatype)
    if field is None:
        raise BadRequest(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise BadRequest(
            f"input {name!r}: {len(values)} elements in contents.{field} do not fill its shape ({count})"
        )
    if datatype == "BYTES":
        return count, _BYTES_ELEMENT_JSON * count + _BYTES_BYTE_JSON * sum(map(len, values))
    return count, _JSON_WIDTHS[datatype] * count


def _decode_raw(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes, count: int) -> list[Any]:
    try:
        data = tensor_from_bytes(raw, tensor.datatype, count)
    except ValueError as exc:
        raise BadRequest(
            f"input {tensor.name!r} ({tensor.datatype}, shape {list(tensor.shape)}): {exc}"
        ) from None
    if tensor.datatype == "BYTES":
        return [_text(tensor.name, v) for v in data]
    return data


def _from_contents(tensor: pb.ModelInferRequest.InferInputTensor) -> list[Any]:
    values = list(getattr(tensor.contents, _CONTENTS[tensor.datatype]))
    if tensor.datatype == "BYTES":
        return [_text(tensor.name, v) for v in values]
    return values


def _text(name: str, value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise BadRequest(
            f"input {name!r}: a BYTES element is not UTF-8 text, which OIP's JSON (the REST form "
            "this call is turned into) cannot carry"
        ) from None


def _is_shape(shape: object) -> TypeGuard[list[int]]:
    return isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _INT64_MAX for d in shape
    )


# --- parameters --------------------------------------------------------------------------------


def _parameters_json(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, parameter in parameters.items():
        if key in _BINARY_PARAMETERS:
            continue
        which = parameter.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(parameter, which)
    return out


def _set_parameters(target: Any, parameters: object) -> None:
    if not isinstance(parameters, dict):
        return
    for key, value in parameters.items():
        if key in _BINARY_PARAMETERS:
            continue
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            target[key].int64_param = value
        elif isinstance(value, int) and 0 <= value < 2**64:
            target[key].uint64_param = value
        elif isinstance(value, float):
            target[key].double_param = value
        elif isinstance(value, str):
            target[key].string_param = value
