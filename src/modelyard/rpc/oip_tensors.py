"""OIP v2 between its gRPC messages and its REST JSON bodies, both ways; pure, no I/O.

A `ModelInferRequest` becomes the JSON body a REST server takes (`inputs[].data` flat, row-major);
tensors that came in `raw_input_contents` (tritonclient.grpc's default) are decoded per datatype:
little-endian, a BYTES element as a 4-byte little-endian length and its bytes (JSON carries it as a
UTF-8 string). The JSON answer becomes a `ModelInferResponse` with every output in
`raw_output_contents`, as Triton answers: tritonclient.grpc's `as_numpy` reads numbers only from
there. The binary-data parameters of the HTTP extension are dropped: the REST hop is plain JSON.
Bad input raises `BadRequest`, a malformed server answer `UpstreamError`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from modelyard.errors import BadRequest, UpstreamError
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb

# datatype -> struct format character (little-endian); BF16 and BYTES are handled apart.
_STRUCT = {
    "BOOL": "?",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
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
_BINARY_PARAMETERS = frozenset({"binary_data", "binary_data_output", "binary_data_size"})


def infer_request_json(request: pb.ModelInferRequest) -> dict[str, Any]:
    """The REST body for `request` (its model and version go in the path, not the body)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "send every input raw or none"
        )
    body: dict[str, Any] = {}
    if request.id:
        body["id"] = request.id
    parameters = _parameters_json(request.parameters)
    if parameters:
        body["parameters"] = parameters
    inputs = []
    for i, tensor in enumerate(request.inputs):
        shape = list(tensor.shape)
        count = _element_count(tensor.name, shape)
        if raw:
            data = _decode_raw(tensor.name, tensor.datatype, raw[i], count)
        else:
            data = _from_contents(tensor.name, tensor.datatype, tensor.contents, count)
        item: dict[str, Any] = {"name": tensor.name, "shape": shape, "datatype": tensor.datatype}
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
                f"model {model!r}: outputs[{i}] of the server's response needs a name, datatype and shape"
            )
        tensor = response.outputs.add(name=name, datatype=datatype, shape=shape)
        _set_parameters(tensor.parameters, output.get("parameters"))
        flat: list[object] = []
        _flatten(output.get("data", []), flat)
        try:
            response.raw_output_contents.append(_encode_raw(datatype, flat))
        except (struct.error, TypeError, ValueError, OverflowError) as exc:
            raise UpstreamError(
                f"model {model!r}: output {name!r} is not valid {datatype} data: {exc}"
            ) from None
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


def _element_count(name: str, shape: Sequence[int]) -> int:
    if any(d < 0 for d in shape):
        raise BadRequest(f"input {name!r}: shape {list(shape)} has a negative dimension")
    return math.prod(shape)


def _decode_raw(name: str, datatype: str, raw: bytes, count: int) -> list[Any]:
    if datatype == "BYTES":
        return _decode_bytes_elements(name, raw, count)
    if datatype == "BF16":
        if len(raw) != 2 * count:
            raise BadRequest(f"input {name!r}: {len(raw)} raw bytes do not hold {count} BF16 elements")
        halves = struct.unpack(f"<{count}H", raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    code = _STRUCT.get(datatype)
    if code is None:
        raise BadRequest(f"input {name!r}: unknown datatype {datatype!r}")
    size = struct.calcsize("<" + code)
    if len(raw) != size * count:
        raise BadRequest(
            f"input {name!r}: {len(raw)} raw bytes do not hold {count} {datatype} elements "
            f"({size} bytes each)"
        )
    return list(struct.unpack(f"<{count}{code}", raw))


def _decode_bytes_elements(name: str, raw: bytes, count: int) -> list[Any]:
    items: list[Any] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise BadRequest(f"input {name!r}: a BYTES element's 4-byte length is cut short")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise BadRequest(f"input {name!r}: a BYTES element is shorter than its length prefix")
        items.append(_text(name, raw[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise BadRequest(f"input {name!r}: {len(items)} BYTES elements do not fill its shape ({count})")
    return items


def _from_contents(name: str, datatype: str, contents: pb.InferTensorContents, count: int) -> list[Any]:
    field = _CONTENTS.get(datatype)
    if field is None:
        if datatype in _STRUCT or datatype == "BF16":
            raise BadRequest(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
        raise BadRequest(f"input {name!r}: unknown datatype {datatype!r}")
    values = list(getattr(contents, field))
    if len(values) != count:
        raise BadRequest(
            f"input {name!r}: {len(values)} elements in contents.{field} do not fill its shape ({count})"
        )
    if datatype == "BYTES":
        return [_text(name, v) for v in values]
    return values


def _text(name: str, value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise BadRequest(
            f"input {name!r}: a BYTES element is not UTF-8 text, which the JSON the gateway sends "
            "to the model server cannot carry"
        ) from None


def _encode_raw(datatype: str, flat: list[object]) -> bytes:
    if datatype == "BYTES":
        parts = []
        for item in flat:
            data = (item if isinstance(item, str) else str(item)).encode()
            parts.append(struct.pack("<I", len(data)) + data)
        return b"".join(parts)
    if datatype == "BF16":
        floats = struct.pack(f"<{len(flat)}f", *flat)
        words = struct.unpack(f"<{len(flat)}I", floats)
        return struct.pack(f"<{len(flat)}H", *(w >> 16 for w in words))
    code = _STRUCT.get(datatype)
    if code is None:
        raise ValueError(f"unknown datatype {datatype!r}")
    if code not in "efd?":
        flat = [_integral(x) for x in flat]
    return struct.pack(f"<{len(flat)}{code}", *flat)


def _integral(value: object) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError(f"{value!r} is not an integer")


def _flatten(data: object, out: list[object], depth: int = 0) -> None:
    if depth > 32:
        raise UpstreamError("output data nested deeper than 32 levels")
    if isinstance(data, list):
        for item in data:
            _flatten(item, out, depth + 1)
    else:
        out.append(data)


def _is_shape(shape: object) -> bool:
    return isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)


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
