"""Go's encoding/json, as far as KServe's router lets it show: what it accepts as JSON, how it
decodes a member's answer into map[string]interface{}, and how json.Marshal writes maps back
(compact, keys sorted, numbers through float64, HTML characters escaped)."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any


class GoJsonError(ValueError):
    """A decode failure, worded as Go's encoding/json words it (it becomes a graph error's cause)."""


class _OutOfRange(ValueError):
    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid constant {name}")


def _finite(literal: str) -> float:
    number = float(literal)
    if math.isinf(number):
        raise _OutOfRange(literal)  # Go: cannot unmarshal number 1e400 into float64
    return number


def _loads(data: bytes) -> Any:
    # Go reads invalid UTF-8 inside strings without complaint; surrogateescape keeps those bytes.
    text = data.decode("utf-8", "surrogateescape")
    return json.loads(text, parse_int=_finite, parse_float=_finite, parse_constant=_reject_constant)


def valid(data: bytes) -> bool:
    """Go's json.Valid: one JSON value, optional surrounding whitespace, no NaN/Infinity."""
    try:
        _loads(data)
    except _OutOfRange:
        return True  # syntactically valid; only decoding into float64 fails
    except (ValueError, RecursionError):
        return False
    return True


def decode_object(data: bytes) -> dict[str, Any] | None:
    """json.Unmarshal into map[string]interface{}: an object, or null (None)."""
    try:
        value = _loads(data)
    except _OutOfRange as exc:
        raise GoJsonError(
            f"json: cannot unmarshal number {exc.literal} into Go value of type float64"
        ) from None
    except json.JSONDecodeError as exc:
        raise GoJsonError(_syntax_error(exc)) from None
    except (ValueError, RecursionError):
        raise GoJsonError("invalid character 'N' looking for beginning of value") from None
    if value is None or isinstance(value, dict):
        return value
    kind = {list: "array", str: "string", float: "number", bool: "bool"}[type(value)]
    raise GoJsonError(f"json: cannot unmarshal {kind} into Go value of type map[string]interface {{}}")


def _syntax_error(exc: json.JSONDecodeError) -> str:
    """Python's decode error, worded as Go's scanner words the same fault."""
    text, pos = exc.doc, exc.pos
    if exc.msg.startswith("Illegal trailing comma"):  # Python 3.13 names the comma; Go, what follows it
        pos += 1 + len(text[pos + 1 :]) - len(text[pos + 1 :].lstrip(" \t\r\n"))
        if exc.msg.endswith("object"):
            return f"invalid character {_go_quote_char(text[pos])} looking for beginning of object key string"
    if pos >= len(text.rstrip(" \t\r\n")) or exc.msg.startswith("Unterminated string"):
        return "unexpected end of JSON input"
    char = _go_quote_char(text[pos])
    if exc.msg == "Extra data":
        return f"invalid character {char} after top-level value"
    if exc.msg.startswith("Expecting property name"):
        return f"invalid character {char} looking for beginning of object key string"
    if exc.msg.startswith("Expecting ':'"):
        return f"invalid character {char} after object key"
    if exc.msg.startswith("Expecting ','"):
        inside = "object key:value pair" if _innermost_bracket(text, pos) == "{" else "array element"
        return f"invalid character {char} after {inside}"
    return f"invalid character {char} looking for beginning of value"


def _innermost_bracket(text: str, pos: int) -> str:
    stack: list[str] = []
    in_string = escaped = False
    for char in text[:pos]:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            stack.append(char)
        elif char in "]}" and stack:
            stack.pop()
    return stack[-1] if stack else ""


def decode_predictions(data: bytes) -> list[Any] | None:
    """mapPredictionsToInstances: the `predictions` list when the body decodes into a struct with
    list fields `predictions` and `instances` and `predictions` is non-empty; else None."""
    try:
        value = _loads(data)
    except (ValueError, RecursionError):  # _OutOfRange included: Go fails the decode, sends it unchanged
        return None
    if not isinstance(value, dict):
        return None  # null decodes to an empty struct; an array or scalar fails to decode
    # Go matches JSON keys to struct fields case-insensitively; a later duplicate wins.
    predictions = instances = None
    for key, item in value.items():
        folded = key.lower()
        if folded == "predictions":
            predictions = item
        elif folded == "instances":
            instances = item
    if instances is not None and not isinstance(instances, list):
        return None
    if not isinstance(predictions, list) or not predictions:
        return None
    return predictions


def marshal(value: Any) -> bytes:
    """json.Marshal of decoded values: maps with sorted keys, float64 numbers, HTML-safe strings."""
    parts: list[str] = []
    _encode(value, parts)
    return "".join(parts).encode("utf-8")


def _encode(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, float | int):
        out.append(format_float(float(value)))
    elif isinstance(value, str):
        out.append(quote(value))
    elif isinstance(value, dict):
        out.append("{")
        for i, key in enumerate(sorted(value, key=lambda k: k.encode("utf-8", "surrogateescape"))):
            if i:
                out.append(",")
            out.append(quote(key))
            out.append(":")
            _encode(value[key], out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(item, out)
        out.append("]")
    else:  # pragma: no cover - decoded JSON holds nothing else
        raise TypeError(f"cannot encode {type(value).__name__}")


def format_float(number: float) -> str:
    """strconv.FormatFloat as encoding/json uses it: shortest digits, plain notation for
    1e-6 <= |x| < 1e21, else exponent notation with Go's e-7 (not e-07) clean-up."""
    if math.isinf(number) or math.isnan(number):
        raise ValueError("unsupported value")
    if number == 0:
        return "-0" if math.copysign(1.0, number) < 0 else "0"
    shortest = repr(number)
    if 1e-6 <= abs(number) < 1e21:
        text = format(Decimal(shortest), "f")
        if "." in text:
            text = text.rstrip("0").rstrip(".")
        return text
    mantissa, _, exponent = shortest.partition("e")
    if mantissa.endswith(".0"):
        mantissa = mantissa[:-2]
    sign = "-" if exponent.startswith("-") else "+"
    digits = exponent.lstrip("+-").lstrip("0") or "0"
    return f"{mantissa}e{sign}{digits}"


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_ESCAPES.update({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def quote(text: str) -> str:
    out = ['"']
    for char in text:
        escaped = _ESCAPES.get(char)
        if escaped is not None:
            out.append(escaped)
        elif char < " ":
            out.append(f"\\u{ord(char):04x}")
        elif "\ud800" <= char <= "\udfff":  # not UTF-8, or a lone surrogate escape: Go writes U+FFFD
            out.append("\ufffd")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _go_quote_char(char: str) -> str:
    return "'\\''" if char == "'" else f"'{char}'"
