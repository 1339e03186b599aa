"""Responses the serving layer writes itself: a graph's answer as aiohttp's response, and error
envelopes written straight to a socket when no request object exists (a refused connection, a head
that never completed)."""

from __future__ import annotations

from http import HTTPStatus
from urllib.parse import urlsplit

from aiohttp import web

from modelyard.errors import ModelyardError
from modelyard.graph import Answer
from modelyard.protocols import error_body, protocol_for_path
from modelyard.types import Protocol


def answer_response(answer: Answer) -> web.Response:
    """A graph's answer as KServe's router writes it: no Content-Type when the answer has none
    (aiohttp would say application/octet-stream; Go's server says nothing)."""
    response = web.Response(status=answer.status, body=answer.body)
    if answer.content_type is None:
        response.headers.pop("Content-Type", None)
    else:
        response.headers["Content-Type"] = answer.content_type
    return response


def request_path(line: bytes) -> str | None:
    """The path of an HTTP/1 request line (`GET /v2/models/m HTTP/1.1`, origin or absolute form),
    or None when the line is not one."""
    parts = line.rstrip(b"\r\n").split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return None
    target = parts[1].decode("latin-1")
    if target.startswith("/"):
        return target.partition("?")[0]
    if "://" in target:
        try:
            return urlsplit(target).path or "/"
        except ValueError:  # a malformed authority (`http://[x/`)
            return None
    return None  # authority form (CONNECT) or `*` (OPTIONS)


def envelope(path: str | None, error: ModelyardError) -> bytes:
    """The error body of the protocol the path speaks; the plain (OpenAI-shaped) one without a path."""
    return error_body(protocol_for_path(path) if path is not None else Protocol.PLAIN, error)


def raw_error_response(error: ModelyardError, path: str | None) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, for writing to a bare transport."""
    body = envelope(path, error)
    lines = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in error.headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
