"""Open Inference Protocol v2 and KServe v1 requests: the model is in the path, the body is JSON.

OIP's binary tensor extension (Triton's and KServe's) sends a JSON header of
`Inference-Header-Content-Length` bytes followed by the raw tensors of the inputs that carry
`"parameters": {"binary_data_size": N}` (and no `data`), in input order. Outputs asked for with
`"parameters": {"binary_data": true}` (or every output, with the request's top-level
`"binary_data_output": true`) come back the same way: the response's own header gives its JSON
length and each binary output carries `binary_data_size`. Tensors are little-endian, row-major;
a BYTES element is a 4-byte little-endian length and then its bytes; BOOL is one byte.

Routing parses only the JSON header and checks that the sizes it names add up to the bytes after
it; `read_infer_request` and `write_infer_response` decode and encode the tensors themselves.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import orjson

from modelyard.errors import MalformedBody
from modelyard.protocols.openai import parse_json_object
from modelyard.protocols.tokens import tokens_in_bytes
from modelyard.types import RoutingRequest

BINARY_HEADER = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"

# struct codes of the fixed-size datatypes; BF16 (2 bytes) and BYTES (length-prefixed) are apart.
_STRUCT_CODES = {
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
# datatype -> bytes per element (BYTES is length-prefixed, apart).
ITEM_SIZES = {name: struct.calcsize("<" + code) for name, code in _STRUCT_CODES.items()} | {"BF16": 2}
BINARY_DATATYPES = frozenset(ITEM_SIZES) | {"BYTES"}
MAX_DATA_DEPTH = 32
_FLOAT_CODES = frozenset("efd")


def path_for_model(path: str, model: str) -> str | None:
    """The request path `path` (with its query) naming `model` instead: OIP v2's
    `/v2/models/{name}[/versions/{v}]/{rest}` (the version is the first model's: dropped) or KServe
    v1's `/v1/models/{name}:predict`. None when `path` names no model that way."""
    route, mark, query = path.partition("?")
    named = quote(model, safe="")
    if route.startswith("/v2/models/"):
        _, _, rest = route[len("/v2/models/") :].partition("/")
        if rest.startswith("versions/"):
            rest = rest[len("versions/") :].partition("/")[2]
        return f"/v2/models/{named}/{rest}{mark}{query}" if rest else None
    if route.startswith("/v1/models/") and route.endswith(":predict"):
        return f"/v1/models/{named}:predict{mark}{query}"
    return None


def routing_request(
    model: str, body: bytes, headers: Mapping[str, str], *, affinity_chars: int
) -> RoutingRequest:
    length = binary_header_length(headers)
    json_part, tail = (body, None) if length is None else split_binary(body, length)
    fields = parse_json_object(json_part)
    if tail is not None:  # a plain JSON body's inputs are not walked: they are the server's
        binary_input_spans(fields, len(tail))  # the sizes must add up; the tensors are the server's
    # Tensors have no prompt; the leading bytes of the request stand in for one so that
    # identical inputs share affinity under kv_aware.
    prompt = json_part[:affinity_chars].decode("utf-8", "replace")
    return RoutingRequest(model=model, prompt=prompt, prompt_tokens=tokens_in_bytes(len(body)), fields=fields)


# The binary tensor extension -----------------------------------------------------------------


def binary_header_length(headers: Mapping[str, str]) -> int | None:
    """The JSON header's length from `Inference-Header-Content-Length`; None when absent."""
    value = headers.get(BINARY_HEADER)
    if value is None:
        return None
    # Plain ASCII digits only: int() would also take "+5", " 5 ", "1_0" and other scripts' digits.
    if not (value.isascii() and value.isdigit()):
        raise MalformedBody(f"{BINARY_HEADER} must be a non-negative decimal integer, got {value!r}")
    return int(value)


def split_binary(body: bytes, length: int) -> tuple[bytes, memoryview]:
    """(the JSON header, the raw tensor bytes after it)."""
    if not 0 < length <= len(body):
        raise MalformedBody(f"{BINARY_HEADER} is {length} but the body has {len(body)} bytes")
    return body[:length], memoryview(body)[length:]


def _name(tensor: Mapping[str, Any], i: int) -> str:
    name = tensor.get("name")
    return name if isinstance(name, str) else f"inputs[{i}]"


def _binary_size(tensor: Mapping[str, Any], what: str) -> int | None:
    parameters = tensor.get("parameters")
    if not isinstance(parameters, dict) or "binary_data_size" not in parameters:
        return None
    size = parameters["binary_data_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise MalformedBody(f"{what}: binary_data_size must be a non-negative integer, got {size!r}")
    return size


def binary_input_spans(fields: Mapping[str, Any], available: int | None) -> list[tuple[int, int, int]]:
    """(input index, start, end) of each binary input in the `available` bytes after the JSON
    header (None: the request has no binary part); MalformedBody when the sizes run past those
    bytes or leave some over."""
    inputs = fields.get("inputs")
    spans: list[tuple[int, int, int]] = []
    offset = 0
    for i, tensor in enumerate(inputs if isinstance(inputs, list) else ()):
        if not isinstance(tensor, dict):
            continue  # the server says what is wrong with it
        what = f"input {_name(tensor, i)!r}"
        size = _binary_size(tensor, what)
        if size is None:
            continue
        if available is None:
            raise MalformedBody(
                f"{what} has parameters.binary_data_size but the request has no {BINARY_HEADER}"
            )
        if "data" in tensor:
            raise MalformedBody(f"{what} has both 'data' and parameters.binary_data_size")
        if offset + size > available:
            raise MalformedBody(
                f"{what}: binary_data_size {size} runs past the end of the body "
                f"({available - offset} bytes left after the JSON header)"
            )
        spans.append((i, offset, offset + size))
        offset += size
    if available is not None and offset != available:
        raise MalformedBody(
            f"{available - offset} bytes after the JSON header are not claimed by any binary_data_size"
        )
    return spans


def read_infer_request(body: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
    """An infer request as JSON would carry it: each binary input gets its flat `data` (BYTES
    elements as `bytes`) and loses `binary_data_size`. MalformedBody names what is wrong."""
    length = binary_header_length(headers)
    if length is None:
        fields, tail = parse_json_object(body), memoryview(b"")
    else:
        head, tail = split_binary(body, length)
        fields = parse_json_object(head)
    for i, start, end in binary_input_spans(fields, None if length is None else len(tail)):
        tensor = fields["inputs"][i]
        what = f"input {_name(tensor, i)!r}"
        datatype, shape = tensor.get("datatype"), tensor.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise MalformedBody(f"{what}: shape must be a list of non-negative integers")
        if datatype not in BINARY_DATATYPES:
            raise MalformedBody(f"{what}: unknown datatype {datatype!r}")
        try:
            tensor["data"] = tensor_from_bytes(tail[start:end], datatype, math.prod(shape))
        except ValueError as exc:
            raise MalformedBody(f"{what} (shape {shape}, {datatype}): {exc}") from None
        parameters = tensor["parameters"]
        del parameters["binary_data_size"]
        if not parameters:
            del tensor["parameters"]
    return fields


def wants_binary(request: Mapping[str, Any], output: str) -> bool:
    """Whether `output` goes back in binary: its own `binary_data` parameter, else the request's
    top-level `binary_data_output`."""
    for requested in request.get("outputs") or ():
        if isinstance(requested, dict) and requested.get("name") == output:
            parameters = requested.get("parameters")
            if isinstance(parameters, dict) and "binary_data" in parameters:
                return parameters["binary_data"] is True
            break
    parameters = request.get("parameters")
    return isinstance(parameters, dict) and parameters.get("binary_data_output") is True


def write_infer_response(response: Mapping[str, Any], request: Mapping[str, Any]) -> tuple[bytes, int | None]:
    """The response body for `request` and, when an output goes in binary, its JSON header's
    length (for `Inference-Header-Content-Length`). BYTES elements may be `str` or `bytes`;
    ValueError when an output cannot be encoded as asked (names the output)."""
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for output in response.get("outputs") or ():
        name, datatype, data = output["name"], output["datatype"], output["data"]
        try:
            if wants_binary(request, name):
                raw = tensor_to_bytes(data, datatype)
                parameters = {**(output.get("parameters") or {}), "binary_data_size": len(raw)}
                outputs.append({k: v for k, v in output.items() if k != "data"} | {"parameters": parameters})
                chunks.append(raw)
            elif datatype == "BYTES":
                outputs.append({**output, "data": [_text(x) for x in data]})
            else:
                outputs.append(dict(output))
        except ValueError as exc:
            raise ValueError(f"output {name!r}: {exc}") from None
    head = orjson.dumps({**response, "outputs": outputs})
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)


def _text(element: object) -> object:
    if isinstance(element, bytes):
        try:
            return element.decode()
        except UnicodeDecodeError:
            raise ValueError("BYTES data is not valid UTF-8; ask for it with binary_data") from None
    return element


# Tensors ---------------------------------------------------------------------------------------


def flatten(data: object) -> list[object]:
    """A tensor's `data` (nested lists, row-major) flat; ValueError when it is nested deeper than
    `MAX_DATA_DEPTH` levels."""
    out: list[object] = []
    _flatten_into(data, out, 0)
    return out


def _flatten_into(data: object, out: list[object], depth: int) -> None:
    if depth > MAX_DATA_DEPTH:
        raise ValueError(f"data nested deeper than {MAX_DATA_DEPTH} levels")
    if isinstance(data, list):
        for item in data:
            _flatten_into(item, out, depth + 1)
    else:
        out.append(data)


def tensor_from_bytes(raw: bytes | memoryview, datatype: str, count: int) -> list[Any]:
    """The `count` elements of a `datatype` tensor, flat; ValueError when the bytes do not hold
    exactly that many."""
    if datatype == "BYTES":
        return _bytes_elements(raw, count)
    size = ITEM_SIZES.get(datatype)
    if size is None:
        raise ValueError(f"unknown datatype {datatype!r}")
    if len(raw) != count * size:
        raise ValueError(f"{len(raw)} bytes of binary data, {count * size} expected")
    if datatype == "BF16":
        return [_from_bf16(bits) for bits in struct.unpack(f"<{count}H", raw)]
    return list(struct.unpack(f"<{count}{_STRUCT_CODES[datatype]}", raw))


def _bytes_elements(raw: bytes | memoryview, count: int) -> list[Any]:
    elements: list[Any] = []
    offset = 0
    while offset < len(raw):
        if len(elements) == count:
            raise ValueError(f"{len(raw) - offset} bytes after the last of {count} BYTES elements")
        if offset + 4 > len(raw):
            raise ValueError(f"BYTES element {len(elements)}: its 4-byte length is cut off")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise ValueError(f"BYTES element {len(elements)} of {length} bytes runs past the data")
        elements.append(bytes(raw[offset : offset + length]))
        offset += length
    if len(elements) != count:
        raise ValueError(f"{len(elements)} BYTES elements, {count} expected")
    return elements


def tensor_to_bytes(data: Sequence[Any], datatype: str) -> bytes:
    """The raw bytes of flat `data` as `datatype`; ValueError when an element does not fit. BOOL
    takes true, false, 0 and 1; an integer type takes an integral float (6.0); a float beyond
    FP16's or FP32's range becomes infinity, and BF16 rounds to nearest, ties to even."""
    if datatype == "BYTES":
        parts: list[bytes] = []
        for element in data:
            if isinstance(element, str):
                element = element.encode()
            elif not isinstance(element, bytes | bytearray):
                raise ValueError(f"BYTES elements must be strings or bytes, got {type(element).__name__}")
            parts.append(struct.pack("<I", len(element)) + element)
        return b"".join(parts)
    if datatype == "BF16":
        return struct.pack(f"<{len(data)}H", *(_to_bf16(x) for x in data))
    code = _STRUCT_CODES.get(datatype)
    if code is None:
        raise ValueError(f"unknown datatype {datatype!r}")
    try:
        if code == "?":
            data = [_boolean(x) for x in data]  # struct would take any truthy value, "no" included
        elif code not in _FLOAT_CODES:
            data = [_integral(x) for x in data]
    except ValueError as exc:
        raise ValueError(f"{datatype} data does not fit: {exc}") from None
    try:
        return struct.pack(f"<{len(data)}{code}", *data)
    except OverflowError:  # a float beyond the datatype's range: infinity, as numpy casts it
        return struct.pack(f"<{len(data)}{code}", *(_clamped(x, code) for x in data))
    except struct.error as exc:
        raise ValueError(f"{datatype} data does not fit: {exc}") from None


def _boolean(x: Any) -> bool:
    if isinstance(x, bool):
        return x
    if isinstance(x, int) and x in (0, 1):
        return bool(x)
    raise ValueError(f"{x!r} is not a BOOL (true, false, 0 or 1)")


def _integral(x: Any) -> int:
    """An integer element; JSON servers may write one as a float (6.0), which is taken."""
    if isinstance(x, int):
        return x
    if isinstance(x, float) and x.is_integer():
        return int(x)
    raise ValueError(f"{x!r} is not an integer")


def _clamped(x: Any, code: str) -> float:
    try:
        struct.pack("<" + code, x)
    except OverflowError:
        return math.copysign(math.inf, x)
    except struct.error as exc:
        raise ValueError(f"{x!r} is not a number: {exc}") from None
    return float(x)


def _from_bf16(bits: int) -> float:
    value: float = struct.unpack("<f", struct.pack("<I", bits << 16))[0]
    return value


def _to_bf16(x: Any) -> int:
    bits: int = struct.unpack("<I", struct.pack("<f", _clamped(x, "f")))[0]
    if math.isnan(x):
        return (bits >> 16) | 0x0040  # stays a (quiet) NaN
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest, ties to even
