"""A lean HTTP/1.1 connection for the routes that carry a server's traffic: an asyncio protocol
over httptools, without aiohttp's request, response and dispatch objects (20-36% of the gateway's
CPU per proxied request went to them; benchmarks/README.md).

It serves plain requests only: HTTP/1.1, a method and path its router knows, no body or one framed
by Content-Length within the body limit, and no Expect, Upgrade, Transfer-Encoding or
Content-Encoding. Anything else (another path, a malformed or oversized head, a chunked or
compressed body) is handed, with every byte read of it, to aiohttp's connection
(`GuardedConnection`), which answers it and keeps the connection from then on. So each error
envelope, limit and behaviour of the aiohttp server stays one implementation, and a connection
that only ever proxies never leaves this one.

The parser is fed one message at a time: the head up to its blank line, then exactly its body. A
request pipelined behind another is still raw bytes when it is its turn, so it can be handed off
whole. Requests on one connection are answered in order, one at a time: bytes that arrive while
one is answered, until the client has taken its answer (the transport below its high-water mark),
wait, and reading pauses past a bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

import httptools
from aiohttp.http_parser import SINGLETON_HEADERS

from modelyard.protocols.http import (
    HEADER_TEXT,
    NOT_FORWARDED_WITH_ID,
    HeaderView,
    RawHeaders,
    connection_options,
    fields_at,
    worth_keeping,
)
from modelyard.serving.busy_poll import BusyPoll
from modelyard.serving.connection import ListenerStats, head_timeout
from modelyard.serving.drain import Drain
from modelyard.serving.reply import Reply, ReplyHeaders, ReplyStream
from modelyard.serving.responses import raw_error_response, request_path

log = logging.getLogger("modelyard.serving")

Handler = Callable[["H1Request", Reply], Awaitable[None]]
# (method, path) -> the handler and the path's parameters, or None: aiohttp's to answer.
Router = Callable[[str, str], "tuple[Handler, dict[str, str]] | None"]
# aiohttp's connection to take over from this one, given the time left to read the current head.
Successor = Callable[["H1Connection", float], asyncio.Protocol]

# A head not complete within this many bytes goes to aiohttp, which enforces its own limits.
MAX_HEAD_BYTES = 64 * 1024
# Pipelined bytes kept while a request is answered before reading pauses.
MAX_WAITING_BYTES = 256 * 1024
# Fields that may appear once (aiohttp's list, plus Host): a repeat goes to aiohttp, which says 400.
_SINGLETONS = frozenset(name.encode() for name in SINGLETON_HEADERS) | {b"host"}
_CRLF = (13, 10)  # the bytes an empty line before a request starts with
_REFUSED_HEADERS = frozenset({b"transfer-encoding", b"expect", b"content-encoding", b"upgrade"})
_NOT_FORWARDED = frozenset(name.encode() for name in NOT_FORWARDED_WITH_ID)
_MAX_SHAPES = 512  # head shapes remembered per server; past it they are learnt afresh
_MAX_TARGETS = 512  # request targets (method and URL) remembered per server, likewise
_MAX_TARGET_URL = 256  # and only URLs this short (a query string may vary without end)


class _Shape:
    """What the names of a request head's fields tell the lean connection, in their order: worked
    out once for each sequence of names (a client sends the same ones, request after request), then
    applied to each head's values by position."""

    __slots__ = ("connection", "forwarded", "host", "lean", "length", "request_id")

    def __init__(self, names: Sequence[bytes]) -> None:
        lows = [name.lower() for name in names]
        singletons = [low for low in lows if low in _SINGLETONS]
        # aiohttp's to answer: a field this server does not take, or a singleton field repeated
        # (aiohttp refuses a repeat, Host's too, with 400)
        self.lean = not _REFUSED_HEADERS.intersection(lows) and len(singletons) == len(set(singletons))
        self.host = b"host" in lows
        self.length = lows.index(b"content-length") if b"content-length" in lows else -1
        self.request_id = lows.index(b"x-request-id") if b"x-request-id" in lows else -1
        self.connection = [i for i, low in enumerate(lows) if low == b"connection"]
        kept = [i for i, low in enumerate(lows) if low not in _NOT_FORWARDED]
        self.forwarded = fields_at(kept)


class H1Request:
    """One plain request, read whole. Has what `serving.reply.Inbound` asks for. Its headers are
    decoded only when looked up. For a proxy, sorted while they were parsed: `forwarded`, the
    fields that may go on to the next hop (none that protocols.http.NOT_FORWARDED names, that
    a Connection field lists, or X-Request-Id), a list of this request's own, to which the proxy
    adds the X-Request-Id it sends; and `request_id`, the first X-Request-Id as it came."""

    __slots__ = (
        "body",
        "client_max_size",
        "content_length",
        "forwarded",
        "headers",
        "match_info",
        "method",
        "path",
        "raw_headers",
        "raw_path",
        "request_id",
    )

    def __init__(
        self,
        method: str,
        raw_path: str,
        path: str,
        raw_headers: list[tuple[bytes, bytes]],
        match_info: dict[str, str],
        content_length: int | None,
        client_max_size: int,
        forwarded: list[tuple[bytes, bytes]],
        request_id: bytes | None,
    ) -> None:
        self.method = method
        self.raw_path = raw_path
        self.path = path
        self.raw_headers = raw_headers
        self.headers = HeaderView(raw_headers)
        self.forwarded = forwarded
        self.request_id = request_id
        self.match_info = match_info
        self.content_length = content_length
        self.client_max_size = client_max_size
        self.body = b""  # set once it has all arrived

    async def read(self) -> bytes:
        return self.body


class H1Settings:
    """What every lean connection of one server shares."""

    __slots__ = (
        "abandoned",
        "busy",
        "drain",
        "header_timeout",
        "keepalive_timeout",
        "max_body",
        "max_field_size",
        "max_headers",
        "max_line_size",
        "on_lost",
        "router",
        "shapes",
        "stats",
        "stopping",
        "successor",
        "targets",
    )

    def __init__(
        self,
        *,
        router: Router,
        successor: Successor,
        drain: Drain,
        stats: ListenerStats,
        on_lost: Callable[[H1Connection], None],
        max_body: int,
        header_timeout: float,
        keepalive_timeout: float,
        max_line_size: int,
        max_field_size: int,
        max_headers: int,
        abandoned: Callable[[H1Request, float], None] | None = None,
        busy: BusyPoll | None = None,
    ) -> None:
        self.router = router
        self.busy = busy  # listen.busy_poll: told when each request's answer begins and ends
        # Told of a routed request whose client left while its body was read, with the seconds
        # since its head was read (when its body was found incomplete: the same read); not while
        # the server stops, which closes such connections itself.
        self.abandoned = abandoned
        self.successor = successor
        self.stopping = False  # set by the server's stop: answers close, nothing is handed off
        self.drain = drain
        self.stats = stats
        self.on_lost = on_lost
        self.max_body = max_body
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.max_line_size = max_line_size
        self.max_field_size = max_field_size
        self.max_headers = max_headers
        self.shapes: dict[tuple[bytes, ...], _Shape] = {}  # by the names of a head's fields
        # (method, URL) as they came -> as text, the path, and where the router sends it
        self.targets: dict[tuple[bytes, bytes], tuple[str, str, str, tuple[Handler, dict[str, str]]]] = {}


class _NotLean(Exception):
    """Raised from a parser callback: this request is aiohttp's (the parser stops there)."""


class H1Connection(asyncio.Protocol):
    def __init__(self, settings: H1Settings, loop: asyncio.AbstractEventLoop) -> None:
        self._settings = settings
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._raw = bytearray()  # the current request's bytes from its first, and any after it
        self._scanned = 0  # how far _raw was searched for the end of the head
        self._head_end = 0  # the head's length once complete, else 0
        self._body_end = 0  # the request's length once its head is read
        self._body_since = 0.0  # loop time when a routed head's body was found incomplete
        # What the parser callbacks collect for the current head:
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._names: list[bytes] = []
        self._request: H1Request | None = None  # once the head is read and routed
        self._handler: Handler | None = None
        self._complete = False
        self._keep_alive = True
        # The request being answered, from its head until its answer is written out (drained).
        self._task: asyncio.Task[None] | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_deadline = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0  # when the last answer ended
        self._reading_paused = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._handed_off = False
        self._lost = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport
        settings = self._settings
        if settings.stopping:  # accepted as the server began to stop
            self._transport.close()
        elif settings.header_timeout > 0:  # the first head is timed from the connection's start
            self._start_head_timer()
        elif settings.keepalive_timeout > 0:  # no head deadline: the idle one applies from the start
            self._idle_since = self._loop.time()
            due = self._idle_since + settings.keepalive_timeout
            self._idle_timer = self._loop.call_at(due, self._idle_check)

    def data_received(self, data: bytes) -> None:
        if self._handed_off:
            return
        self._raw += data
        if self._task is None:  # else pipelined behind the request being answered: its turn comes
            self._read()
        if self._reading_paused or len(self._raw) > MAX_WAITING_BYTES:
            self._bound_reading()

    def _bound_reading(self) -> None:
        """Pause reading while a request is answered and more than MAX_WAITING_BYTES wait behind it."""
        over = self._task is not None and len(self._raw) > MAX_WAITING_BYTES
        if over != self._reading_paused and self._transport is not None and not self._handed_off:
            self._reading_paused = over
            if over:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    def eof_received(self) -> bool | None:
        # The client is done sending: close, which cancels a request still being answered (as
        # aiohttp's server does; a half-closing client gets no answer from either).
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._stop_timers()
        if self._task is not None:
            self._task.cancel()  # the client went away: stop the request (and its upstream call)
        self._wake_drain()
        self._settings.on_lost(self)
        # A routed request not being answered: its body was still coming. (While the server stops,
        # it closes such connections itself.)
        abandoned, request = self._settings.abandoned, self._request
        waiting = self._task is None and not self._handed_off and not self._settings.stopping
        if abandoned is not None and request is not None and waiting:
            abandoned(request, self._loop.time() - self._body_since)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    # --- for the server ------------------------------------------------------------------

    @property
    def answering(self) -> asyncio.Task[None] | None:
        return self._task

    @property
    def waiting_bytes(self) -> int:
        """Bytes read from the client and not yet taken as a request (pipelined ones)."""
        return len(self._raw)

    @property
    def draining(self) -> bool:
        return self._settings.drain.active

    def close(self) -> None:
        """Close once what is written has been sent (a request being answered is the server's to
        wait for or cancel first)."""
        if self._transport is not None:
            self._transport.close()

    # --- reading -------------------------------------------------------------------------

    def _read(self) -> None:
        """Read requests from `_raw` until one is being answered, more bytes are needed, or the
        connection went to aiohttp."""
        while self._raw and self._task is None and not self._handed_off:
            if not self._head_end and not self._read_head():
                return
            if len(self._raw) < self._body_end:
                if not self._body_since:
                    self._body_since = self._loop.time()
                return  # the rest of the body is still coming
            if self._body_end > self._head_end:
                try:
                    self._parser.feed_data(bytes(self._raw[self._head_end : self._body_end]))
                except httptools.HttpParserError:
                    self._hand_off()  # not expected after a good head; aiohttp says what is wrong
                    return
            self._answer()

    def _read_head(self) -> bool:
        """Feed the parser the head once it is all here; False while it is not (or handed off)."""
        raw = self._raw
        if self._scanned == 0 and raw[0] in _CRLF:
            # Empty lines before a request are allowed (RFC 9112 2.2), bare LFs too.
            del raw[: len(raw) - len(raw.lstrip(b"\r\n"))]
            if not raw:
                return False
        since = self._scanned
        if since and raw[since - 1] == 13:  # a CR at the end of the last read: its LF may be next
            since -= 1
        end = raw.find(b"\r\n\r\n", max(0, self._scanned - 3))
        stop = len(raw) if end < 0 else end + 4
        if raw.count(b"\n", since, stop) != raw.count(b"\r\n", since, stop):
            self._hand_off()  # a line ended by a bare LF: aiohttp's parser says what it makes of it
            return False
        if end < 0:
            if self._head_timer is None and self._settings.header_timeout > 0:
                self._start_head_timer()  # timed from its first byte; most heads come in one read
            self._scanned = len(raw)
            if len(raw) > MAX_HEAD_BYTES:
                self._hand_off()  # too long for this server: aiohttp enforces its own limits
            return False
        self._head_end = stop
        self._stop_head_timer()
        try:
            self._parser.feed_data(bytes(raw[:stop]))
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _NotLean):
                log.error("lean connection: a parser callback failed; aiohttp takes over", exc_info=exc)
            self._hand_off()
            return False
        except httptools.HttpParserError:
            self._hand_off()  # malformed: aiohttp answers it in the protocol's envelope
            return False
        if self._request is None:
            self._hand_off()  # no request in those bytes; aiohttp's parser decides
            return False
        return True

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._settings.max_line_size:
            raise _NotLean

    def on_header(self, name: bytes, value: bytes) -> None:
        # (what the fields mean is worked out once the head is complete: nothing is done before)
        self._fields.append((name, value))
        self._names.append(name)

    def on_headers_complete(self) -> None:
        parser = self._parser
        if parser.get_http_version() != "1.1" or parser.should_upgrade():
            raise _NotLean
        settings = self._settings
        fields = self._fields
        if len(fields) > settings.max_headers:
            raise _NotLean  # aiohttp answers 431
        if self._head_end > settings.max_field_size:  # (a shorter head cannot hold a longer field)
            limit = settings.max_field_size
            if any(len(name) + len(value) > limit for name, value in fields):
                raise _NotLean
        names = tuple(self._names)
        shape = settings.shapes.get(names)
        if shape is None:
            shape = _Shape(names)
            if worth_keeping(names):
                if len(settings.shapes) >= _MAX_SHAPES:
                    settings.shapes.clear()
                settings.shapes[names] = shape
        if not shape.lean or not shape.host:
            raise _NotLean  # (no Host: RFC 9112 3.2 says 400, aiohttp's)
        raw_method = parser.get_method()
        target = settings.targets.get((raw_method, self._url))
        if target is None:
            url = self._url.decode("latin-1")
            path = url.partition("?")[0]
            if not path.startswith("/") or "#" in url or "%" in path or "/." in path or "//" in path:
                raise _NotLean  # absolute form, a fragment, or a path aiohttp decodes or normalises
            method = raw_method.decode("latin-1")
            routed = settings.router(method, path)
            if routed is None:
                raise _NotLean  # not ours
            if not routed[1] and len(self._url) <= _MAX_TARGET_URL:  # a fixed path: remembered
                if len(settings.targets) >= _MAX_TARGETS:
                    settings.targets.clear()
                settings.targets[raw_method, self._url] = method, url, path, routed
        else:
            method, url, path, routed = target
        length = int(fields[shape.length][1]) if shape.length >= 0 else None  # (digits: llhttp checked)
        if length is not None and length > settings.max_body:
            raise _NotLean  # aiohttp answers 413
        forwarded = shape.forwarded(fields)
        if shape.connection:
            listed = connection_options(fields, shape.connection)
            if listed:
                forwarded = [field for field in forwarded if field[0].lower() not in listed]
        request_id = fields[shape.request_id][1] if shape.request_id >= 0 else None
        self._handler, match = routed
        self._request = H1Request(
            method, url, path, fields, match, length, settings.max_body, forwarded, request_id
        )
        self._body_end = self._head_end + (length or 0)
        self._keep_alive = parser.should_keep_alive()  # read here: the parser resets it later

    def on_message_complete(self) -> None:
        self._complete = True

    # --- answering -----------------------------------------------------------------------

    def _answer(self) -> None:
        request, handler = self._request, self._handler
        assert request is not None and handler is not None and self._complete
        raw = self._raw
        request.body = bytes(raw[self._head_end : self._body_end])
        del raw[: self._body_end]
        self._url = b""
        self._fields = []
        self._names = []
        self._request = self._handler = None
        self._complete = False
        self._scanned = self._head_end = self._body_end = self._body_since = 0
        reply = _H1Reply(self, self._keep_alive)
        self._task = self._loop.create_task(self._run(handler, request, reply))

    async def _run(self, handler: Handler, request: H1Request, reply: _H1Reply) -> None:
        busy = self._settings.busy  # (begun and ended here: a task cancelled before it starts runs neither)
        if busy is not None:
            busy.begin()
        try:
            await handler(request, reply)
            if not reply.started:
                raise RuntimeError(f"{request.method} {request.path}: the handler sent no answer")
            if not reply.finished:
                reply.keep_alive = False  # a stream left unfinished (the client went away)
            elif reply.keep_alive and (self._write_paused or self._lost):
                await self.drain()  # the next request waits until the client has read this answer
        except (asyncio.CancelledError, ConnectionError):
            reply.keep_alive = False  # the client went away
        except Exception:  # a handler answers its own errors (the gateway's lean_handler); a bug
            log.exception(
                "unanswered error on %s %s (request %s); closing the connection",
                request.method,
                request.path,
                reply.request_id or "-",
                extra={"request_id": reply.request_id},
            )
            reply.keep_alive = False
        finally:
            self._task = None
            if busy is not None:
                busy.end()
        self._after_answer(reply.keep_alive)

    def _after_answer(self, keep_alive: bool) -> None:
        transport = self._transport
        if transport is None or self._lost:
            return
        if not keep_alive or self._settings.stopping:
            transport.close()
            return
        if self._raw:
            self._read()
        if self._handed_off:
            return
        if self._reading_paused or len(self._raw) > MAX_WAITING_BYTES:
            self._bound_reading()
        self._idle_since = self._loop.time()
        if self._idle_timer is None and self._settings.keepalive_timeout > 0:
            # One timer that looks again when it fires, not one per request.
            due = self._idle_since + self._settings.keepalive_timeout
            self._idle_timer = self._loop.call_at(due, self._idle_check)

    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or self._lost or transport.is_closing():
            raise ConnectionResetError("the client has closed the connection")
        transport.write(data)

    async def drain(self) -> None:
        """Wait while the transport's buffer is over its high-water mark."""
        while self._write_paused and not self._lost:
            waiter = self._drained
            if waiter is None or waiter.done():
                waiter = self._drained = self._loop.create_future()
            await waiter  # one waiter: the connection's one task
        if self._lost:
            raise ConnectionResetError("the client has closed the connection")

    def _wake_drain(self) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- handing off, timers -------------------------------------------------------------

    def _hand_off(self) -> None:
        """aiohttp's connection takes this one over, from the first byte of the current request
        (while the server stops, the connection closes instead)."""
        self._handed_off = True
        settings = self._settings
        timed = self._head_timer is not None
        left = self._head_deadline - self._loop.time() if timed else settings.header_timeout
        self._stop_timers()
        transport = self._transport
        assert transport is not None
        if settings.stopping:
            transport.close()
            return
        successor = settings.successor(self, max(left, 0.001) if settings.header_timeout > 0 else 0.0)
        transport.set_protocol(successor)
        successor.connection_made(transport)
        if self._reading_paused:  # before the bytes: aiohttp may pause again as it takes them
            self._reading_paused = False
            transport.resume_reading()
        raw, self._raw = bytes(self._raw), bytearray()
        if raw:
            successor.data_received(raw)

    def _start_head_timer(self) -> None:
        self._head_deadline = self._loop.time() + self._settings.header_timeout
        self._head_timer = self._loop.call_at(self._head_deadline, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _stop_timers(self) -> None:
        self._stop_head_timer()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self._transport
        if transport is None or self._handed_off or self._task is not None:
            return
        self._settings.stats.header_timeouts += 1
        try:
            if self._raw:
                error = head_timeout(self._settings.header_timeout)
                line_end = self._raw.find(b"\n")
                path = request_path(bytes(self._raw[: line_end + 1])) if line_end >= 0 else None
                transport.write(raw_error_response(error, path))
        finally:
            transport.close()

    def _idle_check(self) -> None:
        """Close the connection if it has been idle (nothing being read or answered) for
        listen.keepalive_timeout; else look again when it could have been."""
        self._idle_timer = None
        if self._transport is None or self._handed_off or self._lost:
            return
        timeout = self._settings.keepalive_timeout
        due = self._idle_since + timeout
        busy = self._task is not None or self._head_end > 0  # answering, or reading a body
        if not busy and due <= self._loop.time():
            self._transport.close()  # (a head in progress is the header timeout's, when there is one)
            return
        if busy:
            due = self._loop.time() + timeout
        self._idle_timer = self._loop.call_at(due, self._idle_check)


# --- writing -------------------------------------------------------------------------------

_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_date_second = 0
_date_line = b""


def _date() -> bytes:
    """The Date header, formatted once a second."""
    global _date_second, _date_line
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_line = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_line


def _head(status: int, headers: ReplyHeaders, framing: bytes, keep_alive: bool) -> bytes:
    line = _STATUS_LINES.get(status) or f"HTTP/1.1 {status} \r\n".encode()
    if isinstance(headers, RawHeaders):
        fields = headers.block()
    else:
        fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()]).encode(*HEADER_TEXT)
    close = b"" if keep_alive else b"Connection: close\r\n"
    return line + fields + framing + close + _date() + b"\r\n"


class _H1Reply:
    __slots__ = ("_connection", "finished", "keep_alive", "request_id", "started")

    def __init__(self, connection: H1Connection, keep_alive: bool) -> None:
        self._connection = connection
        self.keep_alive = keep_alive
        self.request_id: str | None = None
        self.started = False
        self.finished = False

    def _close_if_draining(self) -> None:
        """A drain or stop that began while the request ran closes the connection too, and the
        client hears of it in this answer."""
        if self._connection.draining:
            self.keep_alive = False

    def whole(self, status: int, headers: ReplyHeaders, body: bytes) -> None:
        if self.started:
            raise RuntimeError("this request has been answered")
        self.started = True
        self._close_if_draining()
        # 1xx, 204 and 304 have no body and may not say Content-Length (RFC 9110 8.6)
        framing = b"" if status < 200 or status in (204, 304) else b"Content-Length: %d\r\n" % len(body)
        self._connection.write(_head(status, headers, framing, self.keep_alive) + body)
        self.finished = True

    async def stream(self, status: int, headers: ReplyHeaders) -> ReplyStream:
        if self.started:
            raise RuntimeError("this request has been answered")
        self.started = True
        self._close_if_draining()
        self._connection.write(_head(status, headers, b"Transfer-Encoding: chunked\r\n", self.keep_alive))
        return _H1Stream(self)


class _H1Stream:
    __slots__ = ("_reply",)

    def __init__(self, reply: _H1Reply) -> None:
        self._reply = reply

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return  # an empty chunk would end the body
        connection = self._reply._connection
        connection.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await connection.drain()

    async def end(self) -> None:
        connection = self._reply._connection
        connection.write(b"0\r\n\r\n")
        self._reply.finished = True
        await connection.drain()
