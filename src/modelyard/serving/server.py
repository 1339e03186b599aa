"""`HttpServer`: an aiohttp application on a listening socket, with the listener's limits (header
timeout, keep-alive, open connections), a drain, and a bounded shutdown."""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import gc
import logging
import ssl
import weakref
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from modelyard.config import ListenConfig
from modelyard.security.tls import ServerTls
from modelyard.serving.busy_poll import BusyPoll
from modelyard.serving.connection import MAX_REFUSALS, GuardedConnection, ListenerStats, Refusal
from modelyard.serving.drain import closing_while_draining, install_drain
from modelyard.serving.h1 import H1Connection, H1Request, H1Settings, Router

log = logging.getLogger("modelyard.serving")

try:
    import uvloop.loop as _UVLOOP
except ImportError:  # (uvloop is not made for Windows)
    _UVLOOP = None  # type: ignore[assignment]

# TLS handshakes under way at once, per listener (each holds about 300 KiB of asyncio's buffers):
# as many as the listen backlog, which is the most clients a burst brings at once (a gateway that
# restarts, a load balancer that fails over: 256 reset most of a burst of 1,000); a flood of
# connections that never finish one is bounded to about 300 MiB, and refused beyond it.
MAX_HANDSHAKES = 1024
# aiohttp's defaults for the request parser, kept for every server but the graph router.
MAX_LINE_SIZE = 8190
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 128


class HttpServer:
    """Serves `app` as `listen` says. `start()` binds (port 0 picks a free port) and returns the URL;
    `begin_drain()` turns readiness to 503 and answers every request that starts from then on with
    `Connection: close`;
    `stop()` closes the listener, then waits up to `listen.shutdown_timeout` for requests in flight.

    Connections are aiohttp's own request handler (`runner.server` keeps dispatching to the app and
    tracking connections for shutdown), made by this server's protocol factory instead of TCPSite's
    so that each one gets the header deadline and the connection limit applies at accept time.

    With `listen.tls`, it serves HTTPS: certificate files checked at construction (a `TlsError`
    naming the file), reloaded while it runs when they change (`security/tls.py`). The TLS layer
    is put on each accepted connection here (`tls_protocol`), so that connections count against
    the limit from accept and a connection over it is closed before any handshake; the
    connection's own protocol is made once its handshake is done (`_AfterHandshake`).

    With a `lean` router, connections start as the lean HTTP/1.1 connection (h1.py), which answers
    the routes the router knows and hands the connection to aiohttp's handler at the first request
    it does not. `lean_abandoned` is told of each request on those routes whose client left while
    its body was read (h1.H1Settings.abandoned). With `listen.busy_poll`, the loop polls without
    sleeping around the lean connections' requests (busy_poll.py).
    """

    def __init__(
        self,
        app: web.Application,
        listen: ListenConfig,
        *,
        handler_cancellation: bool = True,
        max_line_size: int = MAX_LINE_SIZE,
        max_field_size: int = MAX_FIELD_SIZE,
        max_headers: int = MAX_HEADERS,
        backlog: int = 1024,
        reuse_port: bool = False,
        lean: Router | None = None,
        lean_abandoned: Callable[[H1Request, float], None] | None = None,
        max_body_bytes: int = 1024**2,
    ) -> None:
        self.app = app
        self.listen = listen
        self.stats = ListenerStats()
        self.host = listen.host
        self.port = listen.port
        self.url = ""
        self._drain = install_drain(app)
        self._handler_cancellation = handler_cancellation
        self._parser_limits = (max_line_size, max_field_size, max_headers)
        self._backlog = backlog
        self._reuse_port = reuse_port  # workers of one group each bind the port (serving/workers.py)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._refusals: set[Refusal] = set()
        self._lean_router = lean
        self._lean_abandoned = lean_abandoned  # see H1Settings.abandoned
        self._lean_stopping: asyncio.Future[None] | None = None
        self._max_body_bytes = max_body_bytes  # the lean connection's; aiohttp's is the app's
        self._lean_settings: H1Settings | None = None
        self._lean: set[H1Connection] = set()
        self.busy_poll: BusyPoll | None = None  # once started, with listen.busy_poll and a lean router
        self.tls = ServerTls(listen.tls) if listen.tls is not None else None
        # The TLS connections whose handshake is under way. asyncio tells their protocol nothing of
        # a handshake that fails or times out, but drops it, so a weak set keeps the count true.
        self._handshaking: weakref.WeakSet[_AfterHandshake] = weakref.WeakSet()
        self._handshake_timeout = listen.header_timeout or 60.0
        self._collected = float("-inf")
        self._tls_watch: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self._drain.active

    @property
    def lean_connections(self) -> tuple[H1Connection, ...]:
        """The open connections still on the lean HTTP/1.1 server (not handed to aiohttp's)."""
        return tuple(self._lean)

    def begin_drain(self) -> None:
        self._drain.active = True

    async def start(self) -> str:
        if self._runner is not None:
            raise RuntimeError("HttpServer already started")
        # handler_cancellation: a client that disconnects cancels its handler (and its upstream call).
        runner = web.AppRunner(
            self.app,
            handler_cancellation=self._handler_cancellation,
            shutdown_timeout=self.listen.shutdown_timeout,
        )
        if self._lean_router is not None:  # first: the app's own cleanup (the gateway's stop) waits
            self.app.on_cleanup.insert(0, self._lean_stopped)
        await runner.setup()
        assert runner.server is not None
        # web.Server hands its request factory to each connection it makes, ours included.
        runner.server.request_factory = closing_while_draining(self._drain, runner.server.request_factory)
        self._runner = runner  # before listening: the first connection may be accepted at once
        if self._lean_router is not None:
            max_line_size, max_field_size, max_headers = self._parser_limits
            if self.listen.busy_poll:
                self.busy_poll = BusyPoll(asyncio.get_running_loop(), self.listen.busy_poll)
            self._lean_settings = H1Settings(
                router=self._lean_router,
                successor=self._successor,
                drain=self._drain,
                stats=self.stats,
                on_lost=self._lean_closed,
                max_body=self._max_body_bytes,
                header_timeout=self.listen.header_timeout,
                keepalive_timeout=self.listen.keepalive_timeout,
                max_line_size=max_line_size,
                max_field_size=max_field_size,
                max_headers=max_headers,
                abandoned=self._lean_abandoned,
                busy=self.busy_poll,
            )
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self._accept_tls if self.tls is not None else self._accept,
                self.listen.host or None,
                self.listen.port,
                backlog=self._backlog,
                reuse_port=self._reuse_port or None,
            )
        except BaseException:
            self._runner = None
            await runner.cleanup()
            raise
        if self.tls is not None:
            self._tls_watch = asyncio.create_task(self.tls.watch())
        bound = self._listener.sockets[0].getsockname()
        self.host = self.listen.host or bound[0]
        self.port = bound[1]
        scheme = "https" if self.tls is not None else "http"
        self.url = (
            f"{scheme}://[{self.host}]:{self.port}"
            if ":" in self.host
            else f"{scheme}://{self.host}:{self.port}"
        )
        return self.url

    def _accept_tls(self) -> asyncio.BaseProtocol:
        """A TLS connection at accept: it holds a place among the handshakes (each costs asyncio
        about 300 KiB of buffers) and counts against max_connections while it shakes hands; past
        either bound it is closed at once, before any handshake is spent on it."""
        assert self.tls is not None
        limit = self.listen.max_connections
        now = asyncio.get_running_loop().time()

        def full() -> bool:
            handshaking = len(self._handshaking)
            return handshaking >= MAX_HANDSHAKES or bool(
                limit and self.stats.open_connections + handshaking >= limit
            )

        if full():
            # uvloop frees a failed handshake's protocol at once; asyncio's own loop leaves it in a
            # reference cycle (the failure's traceback) until the collector runs: run it (its
            # older generation at most once a second). And a handshake past its timeout has ended,
            # whether seen to or not.
            gc.collect(0)  # the youngest generation: where a handshake that just failed is
            if full() and now - self._collected >= 1.0:
                self._collected = now
                gc.collect(1)
            deadline = now - self._handshake_timeout - 1.0
            for stale in [h for h in self._handshaking if h.accepted < deadline]:
                self._handshaking.discard(stale)
            if full():
                self.stats.refused_connections += 1
                return _Dropped()
        waiting = _AfterHandshake(self._accept, now, self._handshaking.discard)
        self._handshaking.add(waiting)  # (weak: gone with the connection, whatever ended it)
        return tls_protocol(waiting, self.tls.context, self._handshake_timeout)

    def _accept(self) -> asyncio.Protocol:
        loop = asyncio.get_running_loop()
        limit = self.listen.max_connections
        if limit and self.stats.open_connections >= limit:
            self.stats.refused_connections += 1
            # A refusal waits for the request line at most as long as a head may take.
            refusal = Refusal(
                loop,
                self.listen.header_timeout or 10.0,
                self._refusals.discard,
                answer=len(self._refusals) < MAX_REFUSALS,
            )
            self._refusals.add(refusal)
            return refusal
        self.stats.open_connections += 1
        if self._lean_settings is not None:
            connection = H1Connection(self._lean_settings, loop)
            self._lean.add(connection)
            return connection
        return self._aiohttp_connection()

    def _aiohttp_connection(self, first_head_timeout: float | None = None) -> GuardedConnection:
        assert self._runner is not None and self._runner.server is not None
        max_line_size, max_field_size, max_headers = self._parser_limits
        return GuardedConnection(
            self._runner.server,
            loop=asyncio.get_running_loop(),
            stats=self.stats,
            on_lost=self._connection_closed,
            header_timeout=self.listen.header_timeout,
            first_head_timeout=first_head_timeout,
            keepalive_timeout=self.listen.keepalive_timeout,
            max_line_size=max_line_size,
            max_field_size=max_field_size,
            max_headers=max_headers,
        )

    def _successor(self, connection: H1Connection, head_time_left: float) -> GuardedConnection:
        """aiohttp's connection, taking over a lean one whose current head has this long left."""
        self._lean.discard(connection)  # counted open until aiohttp's connection closes
        return self._aiohttp_connection(head_time_left)

    def _lean_closed(self, connection: H1Connection) -> None:
        self._lean.discard(connection)
        self.stats.open_connections -= 1

    def _connection_closed(self) -> None:
        self.stats.open_connections -= 1

    async def stop(self) -> None:
        """Stop listening, close idle connections, give requests in flight `listen.shutdown_timeout`
        (a lean request cancelled then gets up to a second more to end), then run the app's
        cleanup. Safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._drain.active = True  # whatever is still answered closes its connection
        if self.busy_poll is not None:
            self.busy_poll.close()
        if self._tls_watch is not None:
            self._tls_watch.cancel()
        if self._listener is not None:
            self._listener.close()
        for refusal in list(self._refusals):
            refusal.close()
        # The lean connections stop alongside aiohttp's (runner.cleanup closes its idle ones at
        # once and waits for its requests); the app's own cleanup waits for both (_lean_stopped).
        self._lean_stopping = asyncio.ensure_future(self._stop_lean(self._begin_lean_stop()))
        try:
            await runner.cleanup()
        finally:
            await self._lean_stopping

    async def _lean_stopped(self, _app: web.Application) -> None:
        if self._lean_stopping is None:
            return
        try:
            await asyncio.shield(self._lean_stopping)
        except Exception:  # the app's own cleanup must run whatever happened here
            log.exception("stopping the lean connections failed")

    def _begin_lean_stop(self) -> list[asyncio.Task[None]]:
        """The stop's first, synchronous half, before anything can hand a connection to aiohttp (whose
        server is going): no more hand-offs, idle connections closed; returns the requests in flight."""
        if self._lean_settings is None:
            return []
        self._lean_settings.stopping = True  # an answer that ends now closes its connection
        tasks = [t for c in self._lean if (t := c.answering) is not None]
        for connection in list(self._lean):
            if connection.answering is None:
                connection.close()
        return tasks

    async def _stop_lean(self, tasks: list[asyncio.Task[None]]) -> None:
        """Give the lean requests in flight the shutdown timeout (aiohttp's get theirs in
        `runner.cleanup`), then cancel them and allow them a second to end; each connection closes
        once what it has written is sent, as aiohttp's do."""
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=self.listen.shutdown_timeout or None)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)  # cancelled: they end at their next await
        for connection in list(self._lean):
            connection.close()


def tls_protocol(
    app: asyncio.Protocol, context: ssl.SSLContext, handshake_timeout: float
) -> asyncio.BaseProtocol:
    """The TLS layer of one accepted TCP connection, over `app`: the running loop's own (uvloop's,
    or asyncio's), as `create_server(ssl=...)` would make it. Made here instead, so that a
    connection over the listener's bounds is closed before a handshake (and its buffers) is spent
    on it: a protocol given to `create_server(ssl=...)` hears of nothing before the handshake ends."""
    loop = asyncio.get_running_loop()
    layer: type[Any] = asyncio.sslproto.SSLProtocol
    if _UVLOOP is not None and isinstance(loop, _UVLOOP.Loop):
        layer = _UVLOOP.SSLProtocol
    return cast(
        asyncio.BaseProtocol,
        layer(loop, app, context, None, server_side=True, ssl_handshake_timeout=handshake_timeout),
    )


class _Dropped(asyncio.Protocol):
    """A connection over the listener's bounds at accept: closed before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()  # uvloop's is not an asyncio.Transport


class _AfterHandshake(asyncio.Protocol):
    """What a TLS connection's protocol is until its handshake is done (asyncio calls
    `connection_made` only then): it makes the connection's own protocol, as a plain connection's
    is made at accept, and hands the connection to it."""

    def __init__(
        self,
        accept: Callable[[], asyncio.Protocol],
        accepted: float,
        shaken: Callable[[_AfterHandshake], None],
    ) -> None:
        self._accept = accept
        self._shaken = shaken
        self.accepted = accepted  # the loop's time at accept

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._shaken(self)  # no longer a handshake: the connection's own protocol counts it now
        protocol = self._accept()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
