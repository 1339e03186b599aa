"""How a graph's result is written back, as KServe's router writes it: the status and bytes, with
`Content-Type: application/json` only when the body is JSON (else what Go's content sniffing
would say), and failures as `{"error":"Failed to process request","cause":...}`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from modelyard.graph import go_json
from modelyard.graph.engine import GraphFailure, Outcome

_HTML = re.compile(
    rb"(?i)<(!doctype html|html|head|script|iframe|h1|div|font|table|a|style|title|b|body|br|p|!--)[ >]"
)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    content_type: str | None


def sniff_content_type(body: bytes) -> str | None:
    """Go's http.DetectContentType, in short: nothing for an empty body, HTML, XML, plain UTF-8
    text, or application/octet-stream for binary."""
    if not body:
        return None
    head = body[:512].lstrip(b"\t\n\x0c\r ")
    if _HTML.match(head):
        return "text/html; charset=utf-8"
    if head.startswith(b"<?xml"):
        return "text/xml; charset=utf-8"
    if any(b < 0x20 and b not in (0x09, 0x0A, 0x0C, 0x0D, 0x1B) for b in body[:512]):
        return "application/octet-stream"
    return "text/plain; charset=utf-8"


def failure_body(failure: GraphFailure) -> bytes:
    return b'{"error":"Failed to process request","cause":' + go_json.quote(failure.cause).encode() + b"}"


def answer(result: Outcome | GraphFailure) -> Answer:
    if isinstance(result, GraphFailure):
        return Answer(result.status, failure_body(result), "application/json")
    content_type = "application/json" if go_json.valid(result.body) else sniff_content_type(result.body)
    return Answer(result.status, result.body, content_type)
