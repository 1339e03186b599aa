"""The pure parts of modelyard.serving, and the aiohttp internals it leans on (so that an aiohttp
upgrade that changes them fails here, by name, before anything else)."""

from __future__ import annotations

import inspect

import orjson
import pytest
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, InvalidHeader, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from multidict import CIMultiDict
from pydantic import ValidationError
from yarl import URL

from modelyard.config import ListenConfig
from modelyard.errors import TooManyConnections
from modelyard.graph import Answer
from modelyard.serving import answer_response
from modelyard.serving.connection import TOO_MANY_HEADERS, head_error
from modelyard.serving.responses import raw_error_response, request_path


@pytest.mark.parametrize(
    ("line", "path"),
    [
        (b"GET /v2/models/m/infer HTTP/1.1\r\n", "/v2/models/m/infer"),
        (b"POST /v1/chat/completions?x=1 HTTP/1.1\n", "/v1/chat/completions"),
        (b"GET http://gw:8000/v1/models/m HTTP/1.1\r\n", "/v1/models/m"),
        (b"GET http://gw:8000 HTTP/1.1\r\n", "/"),
        (b"CONNECT gw:443 HTTP/1.1\r\n", None),
        (b"OPTIONS * HTTP/1.1\r\n", None),
        (b"GET /v2 HTTP/1.1 extra\r\n", None),
        (b"\x16\x03\x01\x02\x00\r\n", None),
    ],
)
def test_request_path(line, path):
    assert request_path(line) == path


def test_raw_error_response_is_a_complete_closing_response():
    raw = raw_error_response(TooManyConnections("busy"), "/v2/models/m/infer")
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    assert {"Connection: close", "Retry-After: 1", "Content-Type: application/json"} <= set(lines)
    assert f"Content-Length: {len(body)}" in lines
    assert orjson.loads(body) == {"error": "busy"}  # OIP's envelope
    plain = orjson.loads(raw_error_response(TooManyConnections("busy"), None).partition(b"\r\n\r\n")[2])
    assert plain["error"]["code"] == "too_many_connections"  # no path: the plain (OpenAI) envelope


def test_head_errors_431_for_size_and_400_for_the_rest():
    too_long = head_error(LineTooLong(b"X-Big: aaaa...", 8190), 128)
    assert (too_long.status, too_long.message) == (
        431,
        "the request line or a header field is longer than 8190 bytes",
    )
    too_many = head_error(BadHttpMessage(TOO_MANY_HEADERS), 128)
    assert (too_many.status, too_many.message) == (431, "more than 128 request header fields")
    bad = head_error(InvalidHeader(b"Host a"), 128)
    assert bad.status == 400 and bad.message.startswith("malformed request: Invalid HTTP header")
    multi_line = head_error(BadHttpMessage("Invalid header token:\n\n  b'Host a'\n        ^"), 128)
    assert multi_line.message == "malformed request: Invalid header token"


def test_answer_response_writes_the_content_type_as_go_would():
    json = answer_response(Answer(200, b'{"a":1}', "application/json"))
    assert (json.status, json.body, json.headers["Content-Type"]) == (200, b'{"a":1}', "application/json")
    empty = answer_response(Answer(204, b"", None))
    assert "Content-Type" not in empty.headers


def test_listen_defaults_and_validation():
    listen = ListenConfig()
    assert (listen.header_timeout, listen.keepalive_timeout, listen.max_connections) == (10.0, 75.0, 10_000)
    assert (listen.drain_seconds, listen.shutdown_timeout) == (5.0, 20.0)
    assert ListenConfig(header_timeout="250ms", drain_seconds="1m").model_dump()["drain_seconds"] == 60.0
    for bad in ({"header_timeout": -1}, {"max_connections": -1}, {"drain_timeout": 1}):
        with pytest.raises(ValidationError):
            ListenConfig(**bad)


def test_aiohttp_internals_used_by_guarded_connection():
    """GuardedConnection reads `RequestHandler._messages` and overrides `log_access` and
    `handle_error`; if aiohttp renames or reshapes them, the header deadline and the envelope
    for refused heads stop working silently. This pins them."""
    assert "_messages" in RequestHandler.__slots__
    assert list(inspect.signature(RequestHandler.log_access).parameters) == [
        "self",
        "request",
        "response",
        "time",
    ]
    assert list(inspect.signature(RequestHandler.handle_error).parameters) == [
        "self",
        "request",
        "status",
        "exc",
        "message",
    ]
    assert "log_access" in inspect.getsource(RequestHandler.finish_response)


def test_aiohttp_internals_used_by_the_drain():
    """The drain wraps `web.Server.request_factory`, which each RequestHandler takes at its
    creation, and marks a request `should_close` (what BaseRequest.keep_alive reads)."""
    assert "manager.request_factory" in inspect.getsource(RequestHandler.__init__)
    message = RawRequestMessage(
        "GET", "/", HttpVersion11, CIMultiDict(), (), False, None, False, False, URL("/")
    )
    assert message._replace(should_close=True).should_close is True
    assert "return not self._message.should_close" in inspect.getsource(BaseRequest)  # keep_alive
