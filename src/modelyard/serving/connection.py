"""One client connection: aiohttp's request handler with a deadline on reading each request head,
the error envelope (not aiohttp's plain text and traceback) for heads it cannot take, and the
answer to a connection over the limit.

aiohttp internals used, each pinned by tests/unit/serving/test_connection.py so that an upgrade
that changes one fails there first: `RequestHandler._messages`, the queue of parsed heads, read
(never written) to see when a head completes and whether a body follows it; and the overridden
`log_access` (called once per finished response) and `handle_error` (called for refused heads).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from aiohttp import web
from aiohttp.http import HttpProcessingError, RawRequestMessage
from aiohttp.http_exceptions import LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from modelyard.errors import (
    HeaderFieldsTooLarge,
    MalformedRequest,
    ModelyardError,
    RequestTimeout,
    TooManyConnections,
)
from modelyard.serving.responses import envelope, raw_error_response, request_path

log = logging.getLogger("modelyard.serving")

# keepalive_timeout 0 ("none"): a year, as aiohttp takes 0 for "close after each answer".
NO_KEEPALIVE_LIMIT = 365 * 24 * 3600.0

# aiohttp's parsers raise a plain BadHttpMessage with this text for more than max_headers headers.
TOO_MANY_HEADERS = "Too many headers received"


@dataclass(slots=True)
class ListenerStats:
    """Plain counters kept by a listener; a metrics collector reads them at scrape time, so the
    connection path pays an integer add."""

    open_connections: int = 0
    refused_connections: int = 0
    header_timeouts: int = 0
    refused_heads: dict[int, int] = field(default_factory=lambda: {400: 0, 431: 0})


def head_error(exc: HttpProcessingError, max_headers: int) -> ModelyardError:
    """What to answer a request head aiohttp's parser refused: 431 when it is too large (a line over
    the limit, as Go's net/http answers, or too many headers), else 400."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the"
        return HeaderFieldsTooLarge(f"the request line or a header field is longer than {limit} bytes")
    reason = (exc.message or "").strip().splitlines()
    if reason and reason[0] == TOO_MANY_HEADERS:
        return HeaderFieldsTooLarge(f"more than {max_headers} request header fields")
    first = reason[0].rstrip(":") if reason else "bad request"
    return MalformedRequest(f"malformed request: {first[:200]}")


def head_timeout(limit: float) -> RequestTimeout:
    """What a client whose request head took longer than `listen.header_timeout` is told (408)."""
    return RequestTimeout(f"the request head was not complete within listen.header_timeout ({limit:g}s)")


class GuardedConnection(RequestHandler):
    """aiohttp's handler plus a header-read deadline: from the connection's start for its first
    request, and from the first byte of each next one, until the head is complete. Past it the
    client gets 408 and the connection closes; one that sent nothing is closed silently.

    Heads are told from bodies by the last parsed head's body stream: bytes that arrive while it is
    unfinished are body. A head that starts in the same read as the end of the one before (pipelining)
    is timed from the next read. After an Upgrade request aiohttp buffers the rest itself; heads on
    that connection are then bounded by keepalive_timeout only.
    """

    __slots__ = (
        "_answered",
        "_body",
        "_error_line",
        "_first_head_timeout",
        "_guard_heads",
        "_head_line",
        "_head_started",
        "_head_timer",
        "_header_timeout",
        "_heads",
        "_line",
        "_line_limit",
        "_on_lost",
        "_stats",
        "_timer_loop",
    )

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        stats: ListenerStats,
        on_lost: Callable[[], None],
        header_timeout: float,
        keepalive_timeout: float,
        max_line_size: int,
        max_field_size: int,
        max_headers: int,
        first_head_timeout: float | None = None,
    ) -> None:
        super().__init__(
            manager,
            loop=loop,
            # aiohttp closes at once after each answer with 0; ours means no limit
            keepalive_timeout=keepalive_timeout or NO_KEEPALIVE_LIMIT,
            access_log=None,  # type: ignore[arg-type]  # aiohttp takes None for "no access log"
            max_line_size=max_line_size,
            max_field_size=max_field_size,
            max_headers=max_headers,
        )
        self._timer_loop = loop
        self._stats = stats
        self._on_lost: Callable[[], None] | None = on_lost
        self._header_timeout = header_timeout
        # The first head's deadline, when part of its time went by before this connection took over
        # (a lean connection's hand-off): the heads after it get header_timeout.
        self._first_head_timeout = header_timeout if first_head_timeout is None else first_head_timeout
        self._line_limit = max_line_size + 2  # the request line and its CRLF
        self._guard_heads = header_timeout > 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # a byte of the head being timed has arrived
        self._line: bytes | None = None  # the request line while it is being read
        self._head_line: bytes | None = None  # the request line of the head being read, once read
        self._error_line: bytes | None = None  # the request line of a head aiohttp refused
        self._body: StreamReader | None = None
        self._heads = 0  # heads parsed; against responses finished, tells an idle connection
        self._answered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._guard_heads:  # the first head is timed from the connection's start
            self._head_timer = self._timer_loop.call_later(self._first_head_timeout, self._head_timed_out)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        starts = False  # this read brings the first byte of a head (not body bytes)
        if data and self._guard_heads:
            if not self._head_started:
                starts = self._body is None or self._body.is_eof()
                self._head_started = starts
            elif self._line is not None:
                self._read_line(data)
        queued = len(self._messages)  # aiohttp private: the parsed heads not yet handled
        super().data_received(data)
        fresh = len(self._messages) - queued
        if fresh <= 0:
            if starts:  # the head goes on past this read (most arrive in one): keep its request line
                self._line = b""
                self._read_line(data)
            if self._head_started and self._head_timer is None:
                self._head_timer = self._timer_loop.call_later(self._header_timeout, self._head_timed_out)
            return
        self._heads += fresh
        message, payload = self._messages[-1]
        if isinstance(message, RawRequestMessage):
            self._body = None if payload.is_eof() else payload
            if message.upgrade:
                self._guard_heads = False
        elif fresh == 1:  # aiohttp queued a parse error for the one head of this read
            if starts:
                self._line = b""
                self._read_line(data)
            self._error_line = self._head_line
        if self._head_timer is not None:  # most heads arrive in one read and never start one
            self._stop_head_timer()
        self._head_started = False
        self._line = None
        self._head_line = None

    def _read_line(self, data: bytes) -> None:
        assert self._line is not None
        room = self._line_limit - len(self._line)
        end = data.find(b"\n", 0, room)
        if end >= 0:
            self._head_line = self._line + data[: end + 1]
            self._line = None
        elif len(data) >= room:
            self._line = None  # too long to be read: the plain envelope
        else:
            self._line += data

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport
        if transport is None:
            return
        if self._heads > self._answered:
            # A request ahead of this head (pipelining) is still being answered: time spent waiting
            # for our own response does not count, and a 408 could not be put before it anyway.
            self._head_timer = self._timer_loop.call_later(self._header_timeout, self._head_timed_out)
            return
        self._stats.header_timeouts += 1
        if self._head_started:
            error = head_timeout(self._header_timeout)
            transport.write(raw_error_response(error, _path(self._head_line)))
        self.force_close()

    def log_access(self, request: BaseRequest, response: web.StreamResponse, time: float | None) -> None:
        # aiohttp calls this once per response it finished writing, whether or not it logs.
        self._answered += 1
        super().log_access(request, response, time)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)  # a handler's 500 or 504
        error = head_error(exc, self.max_headers)
        self._stats.refused_heads[error.status] = self._stats.refused_heads.get(error.status, 0) + 1
        log.warning("refused a request head from %s: %d %s", request.remote, error.status, error.message)
        response = web.Response(
            status=error.status,
            body=envelope(_path(self._error_line), error),
            content_type="application/json",
            headers=error.headers,
        )
        response.force_close()
        return response


def _path(line: bytes | None) -> str | None:
    return request_path(line) if line is not None else None


# A refusal lives at most its wait plus this; past this many at once, connections are dropped unanswered.
REFUSAL_LINGER = 1.0
MAX_REFUSALS = 1024


class Refusal(asyncio.Protocol):
    """A connection over listen.max_connections: read the request line (it picks the envelope),
    answer 503 with Retry-After, and close. Its input is read until the client closes, for at most
    REFUSAL_LINGER, so that closing with unread bytes does not reset the answer away."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        wait: float,
        on_lost: Callable[[Refusal], None],
        *,
        answer: bool,
    ) -> None:
        self._loop = loop
        self._wait = wait
        self._on_lost = on_lost
        self._answer = answer
        self._transport: asyncio.Transport | None = None
        self._line = bytearray()
        self._answered = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they do all it does.
        self._transport = transport = cast(asyncio.Transport, transport)
        if not self._answer:
            transport.abort()
            return
        self._timer = self._loop.call_later(self._wait, self.close)

    def data_received(self, data: bytes) -> None:
        if self._answered or self._transport is None:
            return
        self._line += data[: 8192 - len(self._line)]
        end = self._line.find(b"\n")
        if end < 0 and len(self._line) < 8192:
            return
        path = request_path(bytes(self._line[: end + 1])) if end >= 0 else None
        self._answered = True
        error = TooManyConnections("too many connections to this server; retry shortly")
        self._transport.write(raw_error_response(error, path))
        if self._transport.can_write_eof():
            self._transport.write_eof()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(REFUSAL_LINGER, self.close)

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None
        self._on_lost(self)
