"""Deterministic OIP v2 and KServe v1 outputs: every number times `scale`, the rest echoed.

Integers stay integers when the scale is integral; with a fractional scale an INT*/UINT* tensor
comes back as FP64 (the only honest datatype for its data). BOOL and BYTES are echoed (BYTES
elements as they came: `str` from JSON, `bytes` from the binary extension). Pure:
raises ValueError with a client-facing message on bad input.
"""

from __future__ import annotations

import math
from typing import cast

from modelyard.protocols.oip import flatten

_INT_TYPES = frozenset({"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"})
# Each integer datatype's range: data outside it is refused, as a server holding the tensor would
_INT_RANGES = {
    name: range(0, 1 << bits) if name.startswith("U") else range(-(1 << (bits - 1)), 1 << (bits - 1))
    for name, bits in (("INT8", 8), ("INT16", 16), ("INT32", 32), ("INT64", 64),
                       ("UINT8", 8), ("UINT16", 16), ("UINT32", 32), ("UINT64", 64))
}  # fmt: skip
_FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64", "BF16"})
_ECHO_TYPES = frozenset({"BOOL", "BYTES"})
DATATYPES = _INT_TYPES | _FLOAT_TYPES | _ECHO_TYPES
_MAX_DEPTH = 32


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _scale_flat(data: list[object], datatype: str, scale: float) -> tuple[list[object], str]:
    if datatype in _ECHO_TYPES:
        return data, datatype
    if datatype in _INT_TYPES:
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
            raise ValueError(f"{datatype} data must be integers")
        ints = cast(list[int], data)
        valid = _INT_RANGES[datatype]
        if not all(x in valid for x in ints):
            raise ValueError(f"{datatype} data must be within {valid.start}..{valid.stop - 1}")
        if float(scale).is_integer():
            factor = int(scale)
            scaled: list[object] = [x * factor for x in ints]
            if not all(x in valid for x in scaled):
                raise ValueError(f"{datatype} data times {factor} is outside {valid.start}..{valid.stop - 1}")
            return scaled, datatype
        return [x * scale for x in ints], "FP64"
    if not all(_is_number(x) for x in data):
        raise ValueError(f"{datatype} data must be numbers")
    return [float(x) * scale for x in cast(list[float], data)], datatype


def oip_outputs(body: dict[str, object], scale: float) -> list[dict[str, object]]:
    """The `outputs` of an OIP v2 infer response for request `body`."""
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("'inputs' must be a non-empty list")
    wanted = _requested_outputs(body.get("outputs"))
    outputs: dict[str, dict[str, object]] = {}
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, dict):
            raise ValueError(f"inputs[{i}] must be an object")
        name, shape, datatype = tensor.get("name"), tensor.get("shape"), tensor.get("datatype")
        if not isinstance(name, str) or not name:
            raise ValueError(f"inputs[{i}].name must be a non-empty string")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"input {name!r}: shape must be a list of non-negative integers")
        if not isinstance(datatype, str) or datatype not in DATATYPES:
            raise ValueError(f"input {name!r}: unknown datatype {datatype!r}")
        if "data" not in tensor:
            raise ValueError(f"input {name!r}: missing 'data' (or, binary, parameters.binary_data_size)")
        flat = flatten(tensor["data"])
        if len(flat) != math.prod(shape):
            raise ValueError(f"input {name!r}: {len(flat)} elements do not fill shape {shape}")
        data, out_type = _scale_flat(flat, datatype, scale)
        outputs[name] = {"name": name, "shape": shape, "datatype": out_type, "data": data}
    if wanted is None:
        return list(outputs.values())
    missing = [name for name in wanted if name not in outputs]
    if missing:
        raise ValueError(f"unknown output(s) requested: {', '.join(missing)}")
    return [outputs[name] for name in wanted]


def _requested_outputs(value: object) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in value
    ):
        raise ValueError("'outputs' must be a list of objects with a 'name'")
    return [o["name"] for o in value]


def scale_nested(value: object, scale: float, depth: int = 0) -> object:
    """KServe v1: scale every number in `value`, keeping lists, objects and strings as they are."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"instances nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        scaled = value * int(scale) if float(scale).is_integer() else value * scale
        if isinstance(scaled, int) and scaled not in _INT_RANGES["INT64"]:  # (JSON's integers: 64 bits)
            raise ValueError(f"{value} times {scale:g} is outside the 64-bit integers")
        return scaled
    if isinstance(value, float):
        return value * scale
    if isinstance(value, list):
        return [scale_nested(v, scale, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: scale_nested(v, scale, depth + 1) for k, v in value.items()}
    return value
