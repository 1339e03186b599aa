"""A lean HTTP/1.1 keep-alive client for the proxy's hot path.

Why not aiohttp's client here: profiling the gateway under load (py-spy, benchmarks/overhead.py)
showed aiohttp's ClientSession machinery (request/response objects, auto headers, per-request
timers, payload wrappers) taking ~40% of the gateway's CPU, most of the added latency. The proxy
needs far less: send bytes it already has, parse the answer (httptools, the llhttp parser uvicorn
uses), and hand the body over as it arrives. This module is that and nothing more: one pool of
idle connections per upstream, bounded; a deadline per request; responses readable whole or
chunk by chunk with back-pressure. Anything unusual (a reused connection the server had already
closed, a malformed answer) closes the connection rather than guessing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

import httptools

from modelyard.config import TlsClientConfig
from modelyard.errors import BadRequest, UpstreamClosed, UpstreamError, UpstreamTimeout, UpstreamUnreachable
from modelyard.protocols.http import (
    HEADER_TEXT,
    PLAIN_CONNECTION,
    RawHeaders,
    connection_options,
    field_value,
    fields_at,
    worth_keeping,
)
from modelyard.security.tls import ClientTls
from modelyard.upstream.headers import NOT_RELAYED

log = logging.getLogger("modelyard.upstream")

IDLE_TIMEOUT = 4.0  # seconds a kept-alive connection may sit idle; under uvicorn's 5 s default
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
_PAUSE_ABOVE = 256 * 1024  # buffered body bytes before we stop reading from the socket
_RESUME_BELOW = 64 * 1024
_MAX_SHAPES = 512  # answer head shapes remembered per origin; past it they are learnt afresh
_TIMER_STEP = 0.001  # uvloop's timers and clock move in whole milliseconds
# Content-Type values seen, as the media type they say: a few per server, bounded all the same.
_MEDIA_TYPES: dict[bytes, str] = {}
_MAX_MEDIA_TYPES = 256
_MAX_MEDIA_FIELD = 200


# What OpenSSL's message says around its reason: "[SSL: CODE] reason (_ssl.c:1000)".
_SSL_NOISE = re.compile(r"^\[[^\]]*\]\s*|\s*\(_ssl\.c:\d+\)$")


class TlsUrl(str):
    """An https:// (or grpcs://) URL that carries its own TLS settings (a model's or an endpoint's
    `tls`): the client keeps its connections apart from those to the same URL with other settings
    (another client certificate, another CA), as its pools are keyed by the URL. It is equal only
    to a TlsUrl of the same text and settings (never to the plain string), and hashes as its text,
    so that a lookup with the very object a pool was made for costs what a plain string's does.
    Plain URL strings get the client's default TLS (`upstream.tls`)."""

    tls: ClientTls

    def __new__(cls, url: str, tls: ClientTls) -> TlsUrl:
        self = super().__new__(cls, url)
        self.tls = tls
        return self

    def __getnewargs__(self) -> tuple[str, ClientTls]:  # type: ignore[override]
        return str(self), self.tls

    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TlsUrl) and str.__eq__(self, other) and self.tls.config == other.tls.config

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


def system_tls() -> ClientTls:
    """TLS for URLs without settings of their own when no `upstream.tls` is set: the system's CAs,
    the server's certificate and host name verified."""
    return ClientTls(TlsClientConfig())


def tls_reason(exc: ssl.SSLError) -> str:
    """What a failed handshake says, without OpenSSL's codes: "certificate verify failed: unable
    to get local issuer certificate", "tlsv13 alert certificate required"."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    return _SSL_NOISE.sub("", exc.strerror or str(exc)) or exc.reason or type(exc).__name__


class _Shape:
    """What the names of an answer's fields tell the client, in their order: worked out once for
    each sequence of names (a server sends the same ones, answer after answer), then applied to
    each head's values by position."""

    __slots__ = ("chunked", "connection", "content_type", "has_length", "relayed")

    def __init__(self, names: tuple[bytes, ...], drop: frozenset[bytes]) -> None:
        lows = [name.lower() for name in names]
        self.has_length = b"content-length" in lows
        self.chunked = [i for i, low in enumerate(lows) if low == b"transfer-encoding"]
        self.content_type = lows.index(b"content-type") if b"content-type" in lows else -1
        self.connection = [i for i, low in enumerate(lows) if low == b"connection"]
        kept = [i for i, low in enumerate(lows) if low not in drop]
        self.relayed = fields_at(kept)


class _StaleConnection(Exception):
    """A connection closed before answering: a reused keep-alive one, the server timed it out; a
    new one, the server refused it (`tls_error`: with a TLS alert, as a TLS 1.3 server refuses a
    client's certificate, or its absence, after the handshake)."""

    def __init__(self, tls_error: ssl.SSLError | None = None) -> None:
        super().__init__()
        self.tls_error = tls_error


class Flight:
    """A request on its way, which its owner may give up on while no byte of the answer has
    arrived: its endpoint was taken out (a failed health check, an ejection), so waiting on would
    only stall the client. Once a byte has arrived, the answer may already be on its way to a
    client, so `abort` leaves it alone. A request sent another way (gRPC) is given up through
    the callback `on_abort` sets."""

    __slots__ = ("_cancel", "_conn", "_error")

    def __init__(self) -> None:
        self._conn: _Connection | None = None
        self._error: UpstreamError | None = None
        self._cancel: Callable[[UpstreamError], None] | None = None

    def abort(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error  # also stops a request still waiting for a connection
        if self._conn is not None:
            self._conn.abort_if_silent(error)
        if self._cancel is not None:
            self._cancel(error)

    def on_abort(self, cancel: Callable[[UpstreamError], None]) -> None:
        """Call `cancel(error)` when the flight is aborted; at once if it already was."""
        self._cancel = cancel
        if self._error is not None:
            cancel(self._error)


class UpstreamResponse:
    """The head of an upstream answer, with its body to read whole or chunk by chunk.

    Exactly one of `read()` (which also releases the connection) or `close()` must end its use;
    `close()` after a complete body returns the connection to the pool, before it abandons it.

    `raw_headers` are the fields as they came; `headers` decodes them when first asked;
    `relayed` are those a proxy passes on to its client: all but the ones its client's
    `relay_drop` names and those a Connection field lists.
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_headers",
        "_waiter",
        "raw_content_type",
        "raw_headers",
        "relayed",
        "status",
    )

    def __init__(
        self,
        conn: _Connection,
        status: int,
        raw_headers: list[tuple[bytes, bytes]],
        relayed: list[tuple[bytes, bytes]],
        raw_content_type: bytes | None,
    ) -> None:
        self._conn = conn
        self.status = status
        self.raw_headers = raw_headers
        self.relayed = relayed
        self._headers: list[tuple[str, str]] | None = None
        self.raw_content_type = raw_content_type  # the first Content-Type field, as it came
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def headers(self) -> list[tuple[str, str]]:
        if self._headers is None:
            self._headers = list(RawHeaders(self.raw_headers))
        return self._headers

    def header(self, name: str) -> str | None:
        value = field_value(self.raw_headers, name.lower().encode())
        return None if value is None else value.decode(*HEADER_TEXT)

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters ("" if none)."""
        value = self.raw_content_type or b""
        media = _MEDIA_TYPES.get(value)  # (a server sends the same few, and the relay asks each time)
        if media is None:
            media = value.partition(b";")[0].strip().lower().decode(*HEADER_TEXT)
            if len(value) <= _MAX_MEDIA_FIELD:
                if len(_MEDIA_TYPES) >= _MAX_MEDIA_TYPES:
                    _MEDIA_TYPES.clear()
                _MEDIA_TYPES[value] = media
        return media

    @property
    def complete(self) -> bool:
        """The whole body has arrived: `take()` has it without waiting."""
        return self._done and self._error is None

    def take(self) -> bytes:
        """The whole body once `complete`. The caller ends its use with `close()`, which gives
        the connection back: a proxy does that once the body is on its way to its client, which
        should not wait for the pool's bookkeeping."""
        return b"".join(self._chunks)

    async def read(self) -> bytes:
        try:
            while not self._done:
                self._conn.resume_reading()  # the whole body is wanted: never leave the socket paused
                await self._wait()
            return b"".join(self._chunks)
        finally:
            self.close()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered < _RESUME_BELOW:
                    self._conn.resume_reading()
                yield chunk
            elif self._done:
                return
            else:
                await self._wait()

    def close(self) -> None:
        self._conn.finish(self)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None and not self._chunks:
            raise self._error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_ABOVE:
            self._conn.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if (
            not self._done and self._error is None
        ):  # the first cause wins (a timeout, not the close it causes)
            self._error = error
            self._wake()


class _Connection(asyncio.Protocol):
    """One TCP connection and its response parser; carries one request at a time."""

    def __init__(self, pool: _HostPool) -> None:
        self._pool = pool
        self.loop = asyncio.get_running_loop()  # made by create_connection, inside the loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._raw_headers: list[tuple[bytes, bytes]] = []  # the fields of the head being read
        self._names: list[bytes] = []
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        # The exchange's deadline (loop time), and one timer that looks at it when it fires: on a
        # kept-alive connection an exchange's deadline is most often later than the last one's, so
        # the timer armed for an earlier exchange stays and is moved on when it fires (an earlier
        # deadline arms it anew), instead of a timer made and cancelled per request (uvloop's
        # call_later and cancel cost about 2 us together).
        self._due: float | None = None
        self._timeout = 0.0  # what the deadline was given as, for the error
        self._timer: asyncio.Handle | None = None  # (uvloop's call_at makes a plain Handle for a 0 delay)
        self._timer_at = 0.0
        self._received = False
        self._complete = False
        self._close_delimited = False
        self._keep_alive = False
        self._paused = False
        self.closed = False

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abort(UpstreamError(f"{self._pool.origin} sent a malformed HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._response is not None and not self._complete:
            if self._close_delimited and exc is None:
                self._complete = True
                self._response._finish()
            else:
                self._response._fail(UpstreamError(f"{self._pool.origin} closed the connection mid-response"))
        if self._head is not None and not self._head.done():
            error: Exception = (
                _StaleConnection(exc if isinstance(exc, ssl.SSLError) else None)
                if not self._received
                else UpstreamError(f"{self._pool.origin} closed early")
            )
            self._head.set_exception(error)
        self._due = None
        if self._timer is not None:  # (nothing left to time: the connection is not kept waiting for it)
            self._timer.cancel()
            self._timer = None

    # --- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))
        self._names.append(name)

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        raw, names = self._raw_headers, tuple(self._names)
        self._raw_headers, self._names = [], []
        if 100 <= status < 200:  # an interim answer (100 Continue): wait for the real one
            return
        shape = self._pool.shape(names)
        relayed = shape.relayed(raw)
        connection = shape.connection
        if connection and (len(connection) > 1 or raw[connection[0]][1] not in PLAIN_CONNECTION):
            listed = connection_options(raw, connection)
            if listed:
                relayed = [field for field in relayed if field[0].lower() not in listed]
        content_type = raw[shape.content_type][1] if shape.content_type >= 0 else None
        response = UpstreamResponse(self, status, raw, relayed, content_type)
        has_length = shape.has_length
        chunked = any(b"chunked" in raw[i][1].lower() for i in shape.chunked) if shape.chunked else False
        # 204 and 304 have no body by definition; other answers without a length end at close.
        self._close_delimited = not has_length and not chunked and status not in (204, 304)
        # llhttp knows keep-alive only while the message is being parsed, not after it completes.
        self._keep_alive = self._parser.should_keep_alive() and not self._close_delimited
        self._response = response
        if self._head is not None and not self._head.done():
            self._head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._response is None:  # the end of an interim 1xx message
            return
        self._complete = True
        self._due = None
        self._response._finish()

    # --- used by the pool and the response ----------------------------------------------------

    def send(self, payload: bytes, timeout: float | None) -> asyncio.Future[UpstreamResponse]:
        assert self._transport is not None
        self._head = self.loop.create_future()
        self._response = None
        if self._raw_headers:  # the last answer's trailer fields, if it had any, are not this one's
            self._raw_headers, self._names = [], []
        self._received = self._complete = self._close_delimited = self._keep_alive = False
        if timeout:
            due = self.loop.time() + timeout
            self._due, self._timeout = due, timeout
            if self._timer is None or self._timer_at > due:  # (else the armed timer fires first)
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self.loop.call_at(due, self._check_deadline)
                self._timer_at = due
        else:
            self._due = None
        self._transport.write(payload)
        return self._head

    def finish(self, response: UpstreamResponse) -> None:
        """The caller is done with `response`: keep the connection if the exchange ended cleanly."""
        if response is not self._response:
            return
        self._response = None
        self._head = None
        self._due = None
        reusable = self._complete and not self.closed and self._keep_alive
        if reusable:
            self.resume_reading()
        else:
            self._close()
        self._pool.release(self, reusable)

    def abort_if_silent(self, error: UpstreamError) -> None:
        if not self._received and self._head is not None and not self._head.done():
            self._abort(error)

    def abandon(self) -> None:
        """Give up on the exchange in flight (cancelled, failed): the connection cannot be reused."""
        self._response = None
        self._head = None
        self._due = None
        self._close()
        self._pool.release(self, False)

    def expire(self) -> None:
        """Close an idle connection (no exchange in flight)."""
        self._close()

    def pause_reading(self) -> None:
        if not self._paused and self._transport is not None and not self.closed:
            self._paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self._transport is not None and not self.closed:
            self._paused = False
            self._transport.resume_reading()

    def _check_deadline(self) -> None:
        self._timer = None
        due = self._due
        if due is None:
            return  # no exchange with a deadline now: the next one arms a timer of its own
        now = self.loop.time()
        if now < due:  # a later exchange's (or uvloop's whole milliseconds fired it early): look again
            wait = max(due - now, _TIMER_STEP)  # (a shorter wait would run at once, again and again)
            self._timer = self.loop.call_later(wait, self._check_deadline)
            self._timer_at = now + wait
            return
        self._due = None
        self._abort(UpstreamTimeout(f"{self._pool.origin} did not answer within {self._timeout:g}s"))

    def _abort(self, error: UpstreamError) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        if self._response is not None:
            self._response._fail(error)
        self._close()

    def _close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()


class _AfterTlsFailure(_Connection):
    """A connection made while its pool's TLS was failing: its first answer says TLS works again
    (only such connections pay for the check)."""

    def on_headers_complete(self) -> None:
        self._pool.tls_works()
        super().on_headers_complete()


class _HostPool:
    """Idle connections to one upstream origin (with one TLS setting), at most `limit` open at once.
    Over TLS each new connection is made with the newest context (`ClientTls.context()`: files
    read again when they change); a handshake that fails is logged once until one succeeds."""

    def __init__(
        self,
        base_url: str,
        limit: int,
        connect_timeout: float,
        relay_drop: frozenset[bytes],
        tls: ClientTls | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        self.relay_drop = relay_drop
        self._shapes: dict[tuple[bytes, ...], _Shape] = {}
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.prefix = parts.path.rstrip("/")  # a base URL may carry a path: prepended to every request
        self._host = parts.hostname or "localhost"
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = tls if parts.scheme == "https" else None
        # Sent as SNI and verified: the settings' server_name, else the URL's host (an IP address
        # is checked against the certificate's IP addresses and sent as no SNI).
        self._server_name = (self.tls.server_name or self._host) if self.tls is not None else None
        self._tls_failure = ""  # the reason last logged; "" while handshakes succeed
        self.host_header = parts.netloc.encode()
        self._limit = limit
        self._connect_timeout = connect_timeout
        self._idle: list[tuple[_Connection, float]] = []  # (connection, idle since: monotonic), newest last
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def shape(self, names: tuple[bytes, ...]) -> _Shape:
        """What an answer head with fields of these names holds (learnt once per sequence)."""
        shape = self._shapes.get(names)
        if shape is None:
            shape = _Shape(names, self.relay_drop)
            if worth_keeping(names):
                if len(self._shapes) >= _MAX_SHAPES:
                    self._shapes.clear()
                self._shapes[names] = shape
        return shape

    def reuse(self) -> _Connection | None:
        """The most recently used idle connection that is still good. Connections idle longer
        than IDLE_TIMEOUT are closed rather than reused: servers drop idle keep-alives (uvicorn,
        so vLLM, after 5 s), and a request sent on one would be lost in the race."""
        now = time.monotonic()
        while self._idle:
            conn, since = self._idle.pop()
            if not conn.closed and now - since < IDLE_TIMEOUT:
                return conn
            conn.expire()
            self._open -= 1
        return None

    async def acquire(self, until: float | None = None) -> tuple[_Connection, bool]:
        """A connection to send on, and whether it was reused; waits for a free slot at most until
        `until` (loop time), the request's deadline."""
        conn = self.reuse()
        if conn is not None:
            return conn, True
        loop = asyncio.get_running_loop()
        while self._open >= self._limit:
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(until):
                    await waiter
            except TimeoutError:
                self._pass_on(waiter)
                raise UpstreamTimeout(f"{self.origin}: no connection free before the deadline") from None
            except asyncio.CancelledError:
                self._pass_on(waiter)
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            conn = self.reuse()
            if conn is not None:
                return conn, True
        self._open += 1
        try:
            return await self._connect(until), False
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    def _pass_on(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done() and not waiter.cancelled():
            self._wake_one()  # woken, but leaving anyway: the next waiter gets the slot

    async def _connect(self, until: float | None = None) -> _Connection:
        loop = asyncio.get_running_loop()
        limit = loop.time() + self._connect_timeout if self._connect_timeout else None
        if until is not None:
            limit = until if limit is None else min(limit, until)
        protocol = _AfterTlsFailure if self._tls_failure else _Connection
        try:
            async with asyncio.timeout_at(limit):
                _, conn = await loop.create_connection(
                    lambda: protocol(self),
                    self._host,
                    self._port,
                    ssl=self.tls.context() if self.tls is not None else None,
                    server_hostname=self._server_name,
                )
        except TimeoutError:
            raise UpstreamUnreachable(
                f"cannot connect to {self.origin}: no answer within {self._connect_timeout:g}s"
            ) from None
        except ssl.SSLError as exc:
            raise self.tls_failed(tls_reason(exc)) from exc
        except (ConnectionResetError, BrokenPipeError) as exc:
            if self.tls is None:
                raise UpstreamUnreachable(f"cannot connect to {self.origin}: {exc.strerror or exc}") from exc
            # Connected, then cut off: in the handshake (asyncio's servers send no alert).
            raise self.tls_failed(f"the server closed the connection in the handshake{self._hint()}") from exc
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect to {self.origin}: {exc.strerror or exc}") from exc
        return conn

    def _hint(self) -> str:
        if self.tls is None or self.tls.config.cert_file:
            return ""
        return " (it may require a client certificate: tls.cert_file)"

    def closed_unanswered(self, reused: bool, stale: _StaleConnection) -> UpstreamError:
        """A connection closed before answering. A new TLS connection closed so: a server that
        wants a client certificate refuses one after a TLS 1.3 handshake (asyncio's without an
        alert: only a hint then)."""
        if reused:
            return UpstreamClosed(f"{self.origin} closed the connection without answering")
        if stale.tls_error is not None:
            return self.tls_failed(tls_reason(stale.tls_error))
        return UpstreamClosed(f"{self.origin} closed the connection without answering{self._hint()}")

    def tls_failed(self, reason: str) -> UpstreamUnreachable:
        """A handshake failed: logged once (until one succeeds, or the reason changes); the error
        is a connect failure, as a refused connection's. The files are looked at again now: the
        next connection uses a CA or certificate rotated a moment ago."""
        if self.tls is not None:
            self.tls.reload()
        if reason != self._tls_failure:
            self._tls_failure = reason
            name = f" (server name {self._server_name})" if self._server_name != self._host else ""
            log.warning(
                "TLS to %s%s failed: %s; its requests fail until a handshake succeeds (logged once)",
                self.origin, name, reason,
            )  # fmt: skip
        return UpstreamUnreachable(f"cannot connect to {self.origin}: TLS handshake failed: {reason}")

    def tls_works(self) -> None:
        if self._tls_failure:
            self._tls_failure = ""
            log.info("TLS to %s works again", self.origin)

    def release(self, conn: _Connection, reusable: bool) -> None:
        if reusable:
            self._idle.append((conn, time.monotonic()))
        else:
            self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn, _since in self._idle:
            conn.expire()
        self._idle.clear()


def encode_request(
    method: str,
    path: str,
    host: bytes,
    headers: RawHeaders | Iterable[tuple[str, str]],
    body: bytes | None,
) -> bytes:
    """The request head and body as one buffer, so it leaves in one write. BadRequest (nothing is
    sent) when a header name or value holds CR, LF or NUL (RawHeaders cannot)."""
    lines = [f"{method} {path} HTTP/1.1\r\n".encode(*HEADER_TEXT), b"Host: " + host + b"\r\n"]
    if isinstance(headers, RawHeaders):
        lines.append(headers.block())
    else:
        for name, value in headers:
            field = f"{name}: {value}"
            # CR and LF would end a header line early (a header injected, a request smuggled), NUL
            # ends it for some servers: no header name or value may hold one, wherever it came from.
            if "\r" in field or "\n" in field or "\0" in field:
                raise BadRequest(f"header {name[:100]!r}: a header name or value may not hold CR, LF or NUL")
            lines.append(field.encode(*HEADER_TEXT) + b"\r\n")
    if body is not None:
        lines.append(b"Content-Length: %d\r\n" % len(body))
    lines.append(b"\r\n")
    if body:
        lines.append(body)
    return b"".join(lines)


class Http1Client:
    """Keep-alive HTTP/1.1 to any number of upstream origins. `relay_drop`: the answer fields
    (lower-case names) a proxy does not pass on, left out of `UpstreamResponse.relayed`."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        relay_drop: frozenset[bytes] = NOT_RELAYED,
        tls: Callable[[], ClientTls] = system_tls,
    ) -> None:
        """`tls`: the TLS of https:// URLs without their own (a `TlsUrl`'s), asked for when the
        first such pool is made."""
        self._max_connections = max_connections
        self._connect_timeout = connect_timeout
        self._relay_drop = relay_drop
        self._tls = tls
        self._default_tls: ClientTls | None = None
        self._pools: dict[str, _HostPool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _pool(self, base_url: str) -> _HostPool:
        pool = self._pools.get(base_url)
        if pool is None:
            tls = None
            if isinstance(base_url, TlsUrl):
                tls = base_url.tls
            elif urlsplit(base_url).scheme == "https":
                tls = self._default_tls = self._default_tls or self._tls()
            pool = self._pools[base_url] = _HostPool(
                base_url, self._max_connections, self._connect_timeout, self._relay_drop, tls
            )
        return pool

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        headers: RawHeaders | Iterable[tuple[str, str]],
        body: bytes | None,
        deadline: float | None,
        flight: Flight | None = None,
    ) -> UpstreamResponse:
        """Send a request; return once the response head has arrived. `deadline` (seconds) bounds
        the whole exchange, body included; `flight` lets the caller abort it until then."""
        pool = self._pool(base_url)
        payload = encode_request(method, pool.prefix + path, pool.host_header, headers, body)
        loop = self._loop
        if loop is None or loop.is_closed():  # asked once: each ask is a getpid() syscall
            loop = self._loop = asyncio.get_running_loop()
        until = loop.time() + deadline if deadline else None  # waiting and connecting count too
        for _attempt in range(2):
            idle = pool.reuse()  # the usual case, without a coroutine
            conn, reused = (idle, True) if idle is not None else await pool.acquire(until)
            left = None if until is None else until - loop.time()
            if left is not None and left <= 0:
                pool.release(conn, reusable=True)
                raise UpstreamTimeout(f"{pool.origin}: no time left to send the request")
            if flight is not None:
                if flight._error is not None:
                    pool.release(conn, reusable=True)
                    raise flight._error
                flight._conn = conn
            try:
                return await conn.send(payload, left)
            except _StaleConnection as stale:
                conn.abandon()
                # A reused connection closed before any answer: the server dropped it while idle,
                # or took the request and died. Only a request that may run twice is sent again;
                # for the others the caller's retry policy decides ("reset").
                if reused and method in _IDEMPOTENT:
                    continue
                raise pool.closed_unanswered(reused, stale) from None
            except BaseException:
                conn.abandon()
                raise
            finally:
                if flight is not None:
                    flight._conn = None
        raise UpstreamClosed(f"{pool.origin} closed the connection without answering")

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
