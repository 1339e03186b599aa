"""What a handler of the proxied routes reads and how it answers, whichever server carries the
request: aiohttp's (`AiohttpReply`) or the lean HTTP/1.1 connection (`serving/h1.py`).

Only the proxied routes are written this way; the others stay plain aiohttp handlers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict

from modelyard.protocols.http import RawHeaders

# An answer's headers: text, or fields kept as bytes (the proxy relays a server's as they came).
ReplyHeaders = CIMultiDict[str] | RawHeaders


class Inbound(Protocol):
    """The request as a proxied route reads it (aiohttp's `web.Request` is one)."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...  # decoded, without the query
    @property
    def raw_path(self) -> str: ...  # as sent: encoding and query intact
    @property
    def headers(self) -> Mapping[str, str]: ...  # case-insensitive
    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]: ...  # as they came (no CR, LF or NUL)
    @property
    def match_info(self) -> Mapping[str, str]: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def client_max_size(self) -> int: ...  # the body limit the server enforces

    async def read(self) -> bytes: ...


class ReplyStream(Protocol):
    async def write(self, chunk: bytes) -> None:
        """Send one chunk as it is; ConnectionError once the client has gone."""

    async def end(self) -> None: ...


class Reply(Protocol):
    """How a proxied route answers: once, whole or as a stream. `request_id` is set by the
    handler once it knows it, so that an error answered later echoes it too."""

    request_id: str | None

    @property
    def started(self) -> bool: ...  # an answer has begun: an error can no longer be answered

    def whole(self, status: int, headers: ReplyHeaders, body: bytes) -> None: ...
    async def stream(self, status: int, headers: ReplyHeaders) -> ReplyStream: ...


class AiohttpReply:
    """A reply through aiohttp: the handler returns `response` to aiohttp."""

    __slots__ = ("_request", "request_id", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.request_id: str | None = None
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    def whole(self, status: int, headers: ReplyHeaders, body: bytes) -> None:
        self.response = web.Response(status=status, headers=_text(headers), body=body)

    async def stream(self, status: int, headers: ReplyHeaders) -> ReplyStream:
        response = self.response = web.StreamResponse(status=status, headers=_text(headers))
        await response.prepare(self._request)
        return _AiohttpStream(response)


class _AiohttpStream:
    __slots__ = ("_response",)

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response

    async def write(self, chunk: bytes) -> None:
        await self._response.write(chunk)

    async def end(self) -> None:
        await self._response.write_eof()


def _text(headers: ReplyHeaders) -> CIMultiDict[str]:
    return CIMultiDict(headers) if isinstance(headers, RawHeaders) else headers
