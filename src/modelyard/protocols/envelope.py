"""Error envelopes, one per protocol, chosen by the request path."""

from __future__ import annotations

import orjson

from modelyard.errors import ModelyardError
from modelyard.types import Protocol


def protocol_for_path(path: str) -> Protocol:
    """`/v2/...` is OIP; `/v1/models/{m}` and `...:predict` are KServe v1; other `/v1/...` is OpenAI."""
    if path.startswith("/v2/") or path == "/v2":
        return Protocol.OIP
    if path.startswith("/v1/models/"):
        return Protocol.KSERVE_V1
    if path.startswith("/v1/"):
        return Protocol.OPENAI
    return Protocol.PLAIN


def error_body(protocol: Protocol, error: ModelyardError) -> bytes:
    """OpenAI (and the gateway's own endpoints): {"error": {"message", "type", "param", "code"}};
    OIP v2 and KServe v1: {"error": "<message>"}."""
    message = _utf8(error.message)
    if protocol in (Protocol.OIP, Protocol.KSERVE_V1):
        return orjson.dumps({"error": message})
    body: dict[str, object] = {
        "message": message,
        "type": error.error_type,
        "param": None,
        "code": error.code or error.error_type,
    }
    problems = getattr(error, "problems", None)
    if problems:
        body["problems"] = [_utf8(p) for p in problems]  # e.g. every validation error of a graph
    return orjson.dumps({"error": body})


def _utf8(text: str) -> str:
    """Messages quote what clients sent: a JSON or YAML `\\ud800` escape is a lone surrogate, which
    UTF-8 (and so orjson) cannot encode; it is written as that escape instead."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text
