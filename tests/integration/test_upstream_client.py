"""The upstream HTTP/1.1 client against real servers on loopback: aiohttp apps for ordinary
answers, raw asyncio servers that write exact bytes for the protocol's edge cases."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from modelyard.errors import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from modelyard.upstream import not_relayed, relayed_response_headers
from modelyard.upstream.http1 import Http1Client, UpstreamResponse, encode_request

WAIT = 5.0  # the bound on any single wait in these tests

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class RawServer:
    url: str
    connections: int = 0  # accepted so far
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


class Servers:
    """Starts servers on 127.0.0.1 port 0 and stops them all at teardown."""

    def __init__(self) -> None:
        self._runners: list[web.AppRunner] = []
        self._raw: list[tuple[asyncio.Server, RawServer]] = []

    async def web(self, *routes: tuple[str, str, Any]) -> str:
        app = web.Application()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def raw(self, handle: RawHandler) -> RawServer:
        state = RawServer(url="")

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            index = state.connections
            state.connections += 1
            state.tasks.append(asyncio.current_task())  # type: ignore[arg-type]
            state.writers.append(writer)
            try:
                await handle(reader, writer, index)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self._raw.append((server, state))
        state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return state

    async def stop(self) -> None:
        for server, state in self._raw:
            server.close()
            for writer in state.writers:
                writer.close()
            for task in state.tasks:
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*state.tasks, return_exceptions=True), WAIT)
            await asyncio.wait_for(server.wait_closed(), WAIT)
        for runner in self._runners:
            await asyncio.wait_for(runner.cleanup(), WAIT)


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    started = Servers()
    yield started
    await started.stop()


@pytest.fixture
async def clients() -> AsyncIterator[Callable[..., Http1Client]]:
    """`clients(max_connections=4)` makes an Http1Client that is closed at teardown."""
    made: list[Http1Client] = []

    def make(max_connections: int = 4, **options: Any) -> Http1Client:
        client = Http1Client(max_connections=max_connections, connect_timeout=WAIT, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


async def get(client: Http1Client, url: str, path: str, deadline: float | None = WAIT) -> UpstreamResponse:
    return await client.request(url, "GET", path, (), None, deadline)


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request (head and Content-Length body) as raw bytes, or None at end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + (await reader.readexactly(length) if length else b"")


def peer_port(request: web.Request) -> int:
    assert request.transport is not None
    return request.transport.get_extra_info("peername")[1]


async def chunked(response: UpstreamResponse) -> list[bytes]:
    async with aclosing(response.iter_chunks()) as chunks:
        return [chunk async for chunk in chunks]


# --- keep-alive ------------------------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection(servers, clients):
    ports: list[int] = []

    async def ok(request: web.Request) -> web.Response:
        ports.append(peer_port(request))
        return web.Response(text=f"ok {len(ports)}")

    url = await servers.web(("GET", "/ok", ok))
    client = clients()
    async with asyncio.timeout(WAIT):
        for i in range(1, 6):
            response = await get(client, url, "/ok")
            assert response.status == 200
            assert await response.read() == f"ok {i}".encode()
    assert len(ports) == 5
    assert len(set(ports)) == 1


async def test_connection_is_reused_after_a_chunked_stream_is_fully_iterated(servers, clients):
    ports: list[int] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        ports.append(peer_port(request))
        response = web.StreamResponse()
        await response.prepare(request)
        for piece in (b"one ", b"two ", b"three"):
            await response.write(piece)
        await response.write_eof()
        return response

    async def ok(request: web.Request) -> web.Response:
        ports.append(peer_port(request))
        return web.Response(text="ok")

    url = await servers.web(("GET", "/stream", stream), ("GET", "/ok", ok))
    client = clients()
    async with asyncio.timeout(WAIT):
        response = await get(client, url, "/stream")
        assert response.header("Transfer-Encoding") == "chunked"
        assert b"".join(await chunked(response)) == b"one two three"
        response.close()
        response = await get(client, url, "/ok")
        assert await response.read() == b"ok"
        response = await get(client, url, "/stream")
        assert b"".join(await chunked(response)) == b"one two three"
        response.close()
    assert len(ports) == 3
    assert len(set(ports)) == 1


async def test_connection_close_answer_is_read_and_the_next_request_reconnects(servers, clients):
    async def handle(reader, writer, index):
        if await read_request(reader) is None:
            return
        body = f"conn {index}".encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()

    server = await servers.raw(handle)
    client = clients()
    async with asyncio.timeout(WAIT):
        first = await get(client, server.url, "/a")
        assert await first.read() == b"conn 0"
        second = await get(client, server.url, "/b")
        assert await second.read() == b"conn 1"
    assert server.connections == 2


async def test_trailer_fields_are_not_the_next_answers_headers(servers, clients):
    """A chunked answer may end with trailer fields; the next answer on the kept-alive connection
    has only its own head's fields."""

    async def handle(reader, writer, index):
        first = True
        while await read_request(reader) is not None:
            if first:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"2\r\n{}\r\n0\r\nX-Trailer: from-the-first\r\n\r\n"
                )
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nX-Own: second\r\nContent-Length: 2\r\n\r\nok")
            first = False
            await writer.drain()

    server = await servers.raw(handle)
    client = clients()
    async with asyncio.timeout(WAIT):
        assert await (await get(client, server.url, "/a")).read() == b"{}"
        second = await get(client, server.url, "/b")
        assert await second.read() == b"ok"
    assert server.connections == 1
    assert [name for name, _ in second.headers] == ["X-Own", "Content-Length"]
    assert second.header("X-Trailer") is None
    assert second.relayed == [(b"X-Own", b"second")]


ANSWER_FIELDS = [
    (b"Content-Type", b"application/json"),
    (b"Connection", b"keep-alive, X-Hop-Only"),
    (b"X-Hop-Only", b"1"),
    (b"Keep-Alive", b"timeout=5"),
    (b"Date", b"Mon, 01 Jan 2024 00:00:00 GMT"),
    (b"Server", b"uvicorn"),
    (b"X-REQUEST-ID", b"the-servers-own"),
    (b"Set-Cookie", b"a=1"),
    (b"set-cookie", b"b=2"),
    (b"X-Latin", b"\xe9t\xe9"),  # not UTF-8: relayed as the same bytes
    (b"Content-Length", b"2"),
]


async def test_relayed_fields_follow_the_text_rules_and_the_clients_drop_set(servers, clients):
    """`relayed` is what a proxy passes on: every field but hop-by-hop ones (those a Connection
    field lists too), Date, Server, Content-Length and what the client's relay_drop names; repeats
    and their order kept, bytes as they came. An interim 100 answer's fields are not the answer's.
    Answers with the same field names and other values are read by their own values."""
    second = [
        (b"Connection", b"keep-alive") if name == b"Connection" else (name, value)
        for name, value in ANSWER_FIELDS
    ]

    async def handle(reader, writer, index):
        answers = 0
        while await read_request(reader) is not None:
            fields = ANSWER_FIELDS if answers % 2 == 0 else second
            head = b"".join(b"%s: %s\r\n" % field for field in fields)
            writer.write(
                b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\nHTTP/1.1 200 OK\r\n" + head + b"\r\n{}"
            )
            await writer.drain()
            answers += 1

    server = await servers.raw(handle)

    def expected(fields: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        text = [
            (n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")) for n, v in fields
        ]
        return [
            (n.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
            for n, v in relayed_response_headers(text).items()
        ]

    client = clients()
    async with asyncio.timeout(WAIT):
        relayed = []
        for fields in (ANSWER_FIELDS, second, ANSWER_FIELDS):  # on one kept-alive connection
            response = await get(client, server.url, "/a")
            assert await response.read() == b"{}"
            assert response.relayed == expected(fields)
            assert response.raw_content_type == b"application/json"
            relayed.append(response.relayed)
        assert server.connections == 1
        assert (b"X-REQUEST-ID", b"the-servers-own") in relayed[0]
        assert (b"X-Hop-Only", b"1") not in relayed[0] and (b"X-Hop-Only", b"1") in relayed[1]
        response = await get(clients(relay_drop=not_relayed(["X-Request-Id"])), server.url, "/a")
        assert await response.read() == b"{}"
        assert [name for name, _ in response.relayed] == [
            b"Content-Type",
            b"Set-Cookie",
            b"set-cookie",
            b"X-Latin",
        ]


async def test_an_answer_that_closes_the_connection_relays_no_field_named_close(servers, clients):
    """`Connection: close` lists "close": a field of that name is not relayed, as the text rules
    have it (the next request gets a new connection)."""
    fields = [(b"Connection", b"close"), (b"Close", b"1"), (b"X-Kept", b"2"), (b"Content-Length", b"2")]

    async def handle(reader, writer, index):
        if await read_request(reader) is not None:
            head = b"".join(b"%s: %s\r\n" % field for field in fields)
            writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n{}")
            await writer.drain()

    server = await servers.raw(handle)
    text = [(n.decode(), v.decode()) for n, v in fields]
    async with asyncio.timeout(WAIT):
        response = await get(clients(), server.url, "/a")
        assert await response.read() == b"{}"
    assert response.relayed == [(b"X-Kept", b"2")]
    assert list(relayed_response_headers(text).items()) == [("X-Kept", "2")]


@pytest.mark.parametrize("close_when", ["idle", "next_request_arrives"])
async def test_a_reused_connection_the_server_closed_is_replaced_transparently(servers, clients, close_when):
    """'idle': the server closes right after answering; 'next_request_arrives': it reads the next
    request on the kept-alive connection and closes without a byte of answer (a keep-alive timeout
    racing the request), which forces the client's retry path."""
    first_closed = asyncio.Event()

    async def handle(reader, writer, index):
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nconn %d" % index)
            await writer.drain()
            if index == 0:
                if close_when == "next_request_arrives":
                    await read_request(reader)
                writer.close()
                await writer.wait_closed()
                first_closed.set()
                return

    server = await servers.raw(handle)
    client = clients()
    async with asyncio.timeout(WAIT):
        first = await get(client, server.url, "/a")
        assert await first.read() == b"conn 0"
        if close_when == "idle":
            await first_closed.wait()
        second = await get(client, server.url, "/b")
        assert second.status == 200
        assert await second.read() == b"conn 1"
        third = await get(client, server.url, "/c")
        assert await third.read() == b"conn 1"
    assert first_closed.is_set()
    assert server.connections == 2


# --- bodies ----------------------------------------------------------------------------------------


async def test_chunks_are_handed_over_as_they_arrive(servers, clients):
    events: list[str] = []
    gate = asyncio.Event()  # set by the test once it holds the first chunk

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        events.append("server wrote first")
        async with asyncio.timeout(WAIT):
            await gate.wait()
        await response.write(b"second")
        events.append("server wrote second")
        await response.write_eof()
        return response

    url = await servers.web(("GET", "/stream", stream))
    client = clients()
    received = b""
    async with asyncio.timeout(WAIT):
        response = await get(client, url, "/stream")
        async with aclosing(response.iter_chunks()) as chunks:
            async for chunk in chunks:
                received += chunk
                if received == b"first":
                    events.append("client got first")
                    gate.set()  # the server writes the rest only now: nothing was held back
                elif received == b"firstsecond":
                    events.append("client got second")
        response.close()
    assert received == b"firstsecond"
    assert events == ["server wrote first", "client got first", "server wrote second", "client got second"]


async def test_close_delimited_body_is_read_whole(servers, clients):
    async def handle(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello, ")
        await writer.drain()
        writer.write(b"world")
        await writer.drain()

    server = await servers.raw(handle)
    client = clients()
    async with asyncio.timeout(WAIT):
        response = await get(client, server.url, "/")
        assert response.status == 200
        assert await response.read() == b"hello, world"
        again = await get(client, server.url, "/")  # the closed connection was not kept
        assert await again.read() == b"hello, world"
    assert server.connections == 2


async def test_content_length_body_status_and_headers(servers, clients):
    async def handle(reader, writer, index):
        while await read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 201 Created\r\n"
                b"Content-Type: Application/JSON; charset=UTF-8\r\n"
                b"X-Tag: a\r\n"
                b"x-tag: b\r\n"
                b"Content-Length: 11\r\n"
                b"\r\n"
                b'{"ok":true}'
            )
            await writer.drain()

    server = await servers.raw(handle)
    client = clients()
    async with asyncio.timeout(WAIT):
        response = await get(client, server.url, "/")
        body = await response.read()
    assert response.status == 201
    assert body == b'{"ok":true}'
    assert response.header("content-type") == "Application/JSON; charset=UTF-8"
    assert response.header("CONTENT-LENGTH") == "11"
    assert response.header("X-TAG") == "a"
    assert [v for k, v in response.headers if k.lower() == "x-tag"] == ["a", "b"]
    assert response.header("X-Missing") is None
    assert response.content_type == "application/json"


# --- failures --------------------------------------------------------------------------------------


async def test_deadline_raises_timeout_and_the_connection_is_not_reused(servers, clients):
    ports: list[int] = []
    hang_ended = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        ports.append(peer_port(request))
        try:
            async with asyncio.timeout(WAIT):
                await asyncio.Event().wait()
        finally:
            hang_ended.set()
        raise AssertionError("unreachable")

    async def ok(request: web.Request) -> web.Response:
        ports.append(peer_port(request))
        return web.Response(text="ok")

    url = await servers.web(("GET", "/hang", hang), ("GET", "/ok", ok))
    client = clients(max_connections=1)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAIT):
        started = loop.time()
        with pytest.raises(UpstreamTimeout) as caught:
            await get(client, url, "/hang", deadline=0.2)
        elapsed = loop.time() - started
        await hang_ended.wait()  # the server saw the connection go
        response = await get(client, url, "/ok")
        assert await response.read() == b"ok"
    assert caught.value.status == 504
    assert url in str(caught.value)
    assert 0.2 <= elapsed < 2.0
    assert len(ports) == 2
    assert ports[0] != ports[1]


async def test_deadline_during_the_body_raises_timeout(servers, clients):
    hang_ended = asyncio.Event()

    async def stalls(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"partial")
        try:
            async with asyncio.timeout(WAIT):
                await asyncio.Event().wait()
        finally:
            hang_ended.set()
        return response

    url = await servers.web(("GET", "/stalls", stalls))
    client = clients()
    async with asyncio.timeout(WAIT):
        response = await get(client, url, "/stalls", deadline=0.3)
        assert response.status == 200
        await hang_ended.wait()  # the deadline fired and the client closed the connection
        with pytest.raises(UpstreamError) as caught:
            await response.read()
    assert isinstance(caught.value, UpstreamTimeout)
    assert caught.value.status == 504


def answers(
    ports: list[int], text: str, after: float = 0.0
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A handler that notes the client's port, waits `after` seconds, then answers `text`."""

    async def handle(request: web.Request) -> web.Response:
        ports.append(peer_port(request))
        await asyncio.sleep(after)
        return web.Response(text=text)

    return handle


@pytest.mark.parametrize("second_deadline", [3.0, None])
async def test_a_later_request_on_a_kept_alive_connection_is_not_cut_short_by_an_earlier_deadline(
    servers, clients, second_deadline
):
    """The connection keeps one deadline timer across its requests: the timer an earlier request's
    short deadline armed must not cut short a later request with a longer deadline, or none."""
    ports: list[int] = []
    # /slow answers past the first request's deadline, well within the second's
    url = await servers.web(
        ("GET", "/ok", answers(ports, "ok")), ("GET", "/slow", answers(ports, "slow", 0.6))
    )
    client = clients(max_connections=1)
    async with asyncio.timeout(WAIT):
        first = await get(client, url, "/ok", deadline=0.3)
        assert await first.read() == b"ok"
        second = await get(client, url, "/slow", deadline=second_deadline)
        assert await second.read() == b"slow"
    assert len(ports) == 2
    assert ports[0] == ports[1]  # one kept-alive connection, so one timer


async def test_a_shorter_deadline_after_a_longer_one_on_a_kept_alive_connection_fires_on_time(
    servers, clients
):
    ports: list[int] = []
    url = await servers.web(
        ("GET", "/ok", answers(ports, "ok")), ("GET", "/hang", answers(ports, "late", WAIT))
    )
    client = clients(max_connections=1)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAIT):
        first = await get(client, url, "/ok", deadline=WAIT - 1)  # arms the connection's timer late
        assert await first.read() == b"ok"
        started = loop.time()
        with pytest.raises(UpstreamTimeout):
            await get(client, url, "/hang", deadline=0.2)
        elapsed = loop.time() - started
    assert 0.2 <= elapsed < 2.0
    assert ports[0] == ports[1]


async def test_a_connection_whose_deadline_timer_fired_while_idle_is_reused(servers, clients):
    ports: list[int] = []
    url = await servers.web(("GET", "/ok", answers(ports, "ok")))
    client = clients(max_connections=1)
    async with asyncio.timeout(WAIT):
        first = await get(client, url, "/ok", deadline=0.1)
        assert await first.read() == b"ok"
        await asyncio.sleep(0.3)  # the connection sits in the pool past the first request's deadline
        second = await get(client, url, "/ok", deadline=0.5)
        assert await second.read() == b"ok"
    assert ports[0] == ports[1]


async def test_connection_refused_is_unreachable(clients):
    with socket.socket() as bound_not_listening:  # holds the port so nothing else can listen on it
        bound_not_listening.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound_not_listening.getsockname()[1]}"
        async with asyncio.timeout(WAIT):
            with pytest.raises(UpstreamUnreachable) as caught:
                await get(clients(), url, "/")
    assert caught.value.status == 502
    assert url in str(caught.value)


async def test_malformed_response_is_an_upstream_error(servers, clients):
    async def handle(reader, writer, index):
        await read_request(reader)
        writer.write(b"garbage\r\n\r\n")
        await writer.drain()
        await read_request(reader)  # hold the connection open: the client must give up by itself

    server = await servers.raw(handle)
    async with asyncio.timeout(WAIT):
        with pytest.raises(UpstreamError) as caught:
            await get(clients(), server.url, "/", deadline=None)
    assert type(caught.value) is UpstreamError
    assert caught.value.status == 502
    assert "malformed" in str(caught.value)


async def test_server_closing_mid_body_fails_the_read(servers, clients):
    async def handle(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()

    server = await servers.raw(handle)
    async with asyncio.timeout(WAIT):
        response = await get(clients(), server.url, "/", deadline=None)
        assert response.status == 200
        with pytest.raises(UpstreamError) as caught:
            await response.read()
    assert type(caught.value) is UpstreamError
    assert "mid-response" in str(caught.value)


# --- the pool --------------------------------------------------------------------------------------


async def test_max_connections_serialises_concurrent_requests(servers, clients):
    active = 0
    peak = 0
    ports: list[int] = []

    async def slow(request: web.Request) -> web.Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        ports.append(peer_port(request))
        try:
            await asyncio.sleep(0.1)  # the work: a second connection would overlap it
            return web.Response(text=request.query["n"])
        finally:
            active -= 1

    url = await servers.web(("GET", "/slow", slow))
    client = clients(max_connections=1)

    async def call(n: int) -> bytes:
        response = await get(client, url, f"/slow?n={n}")
        return await response.read()

    async with asyncio.timeout(WAIT):
        bodies = await asyncio.gather(call(1), call(2))
    assert bodies == [b"1", b"2"]
    assert peak == 1
    assert len(ports) == 2
    assert len(set(ports)) == 1


async def test_cancelling_a_caller_closes_its_connection_and_frees_the_slot(servers, clients):
    arrived = asyncio.Event()
    handler_ended = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        arrived.set()
        try:
            async with asyncio.timeout(WAIT):
                await asyncio.Event().wait()
        finally:
            handler_ended.set()  # cancelled by aiohttp when the client's connection goes
        raise AssertionError("unreachable")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    url = await servers.web(("GET", "/hang", hang), ("GET", "/ok", ok))
    client = clients(max_connections=1)
    async with asyncio.timeout(WAIT):
        caller = asyncio.create_task(get(client, url, "/hang", deadline=None))
        await arrived.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await handler_ended.wait()
        response = await get(client, url, "/ok")  # with one slot, this needs the slot back
        assert await response.read() == b"ok"


async def test_a_cancelled_waiter_passes_its_turn_on(servers, clients):
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    url = await servers.web(("GET", "/ok", ok))
    client = clients(max_connections=1)
    async with asyncio.timeout(WAIT):
        holder = await get(client, url, "/ok")
        second = asyncio.create_task(get(client, url, "/ok"))
        third = asyncio.create_task(get(client, url, "/ok"))
        await asyncio.sleep(0)  # both start and queue for the only slot
        assert await holder.read() == b"ok"  # the release wakes `second`...
        second.cancel()  # ...which leaves before it gets to run
        with pytest.raises(asyncio.CancelledError):
            await second
    async with asyncio.timeout(1.0):
        response = await third
        assert await response.read() == b"ok"


# --- requests --------------------------------------------------------------------------------------


async def test_base_url_path_prefix_and_host_header(servers, clients):
    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "path": request.path_qs,
                "host": request.headers["Host"],
                "content_length": request.headers.getall("Content-Length"),
                "body": (await request.read()).decode(),
                "x_custom": request.headers.get("X-Custom"),
            }
        )

    url = await servers.web(("POST", "/prefix/v1/echo", echo))
    port = int(url.rsplit(":", 1)[1])
    client = clients()
    async with asyncio.timeout(WAIT):
        response = await client.request(
            url + "/prefix/", "POST", "/v1/echo?x=1", [("X-Custom", "yes")], b'{"a":1}', WAIT
        )
        assert response.status == 200
        assert response.content_type == "application/json"
        seen = json.loads(await response.read())
    assert seen == {
        "path": "/prefix/v1/echo?x=1",
        "host": f"127.0.0.1:{port}",
        "content_length": ["7"],
        "body": '{"a":1}',
        "x_custom": "yes",
    }


def test_encode_request_bytes():
    with_body = encode_request("POST", "/v1/x", b"h:1", [("X-A", "1"), ("Accept", "*/*")], b"hello")
    assert with_body == (
        b"POST /v1/x HTTP/1.1\r\nHost: h:1\r\nX-A: 1\r\nAccept: */*\r\nContent-Length: 5\r\n\r\nhello"
    )
    assert with_body.lower().count(b"content-length:") == 1
    empty = encode_request("POST", "/", b"h", (), b"")
    assert empty == b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n"
    no_body = encode_request("GET", "/", b"h", (), None)
    assert no_body == b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"


# --- back-pressure ---------------------------------------------------------------------------------

BIG = b"".join(i.to_bytes(4, "big") * 4096 for i in range(128))  # 2 MiB of numbered 16 KiB blocks


async def big_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    for start in range(0, len(BIG), 64 * 1024):
        await response.write(BIG[start : start + 64 * 1024])
    await response.write_eof()
    return response


async def big_body(request: web.Request) -> web.Response:
    return web.Response(body=BIG)


async def test_large_stream_iterated_slowly_arrives_complete_and_in_order(servers, clients):
    url = await servers.web(("GET", "/big", big_stream))
    client = clients(max_connections=1)
    pieces: list[bytes] = []
    async with asyncio.timeout(WAIT):
        response = await get(client, url, "/big")
        async with aclosing(response.iter_chunks()) as chunks:
            async for chunk in chunks:
                pieces.append(chunk)
                await asyncio.sleep(0)  # a slow consumer: the socket is paused and resumed
        response.close()
    assert len(pieces) > 1
    assert b"".join(pieces) == BIG


async def test_large_body_read_whole(servers, clients):
    url = await servers.web(("GET", "/big", big_body))
    client = clients()
    async with asyncio.timeout(WAIT):
        response = await get(client, url, "/big", deadline=None)
        assert response.header("Content-Length") == str(len(BIG))
        assert await response.read() == BIG


async def test_bodiless_204_and_304_answers_keep_the_connection(servers, clients):
    ports: list[int] = []

    async def no_content(request: web.Request) -> web.Response:
        ports.append(peer_port(request))
        return web.Response(status=204)

    async def not_modified(request: web.Request) -> web.Response:
        ports.append(peer_port(request))
        return web.Response(status=304)

    url = await servers.web(("GET", "/204", no_content), ("GET", "/304", not_modified))
    client = clients()
    for path in ("/204", "/304", "/204"):
        response = await get(client, url, path)
        assert await response.read() == b""
    assert len(set(ports)) == 1


async def test_a_post_is_not_resent_when_a_reused_connection_closes_without_answering(servers, clients):
    # The server read the POST and then closed: it may have run it. Sending it again could run it
    # twice, so the client reports the failure and leaves the decision to the caller's retry policy.
    received: list[bytes] = []

    async def handle(reader, writer, index):
        while (request := await read_request(reader)) is not None:
            received.append(request.split(b"\r\n\r\n", 1)[1])
            if len(received) == 2:
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    server = await servers.raw(handle)
    client = clients()
    async with asyncio.timeout(WAIT):
        first = await client.request(server.url, "POST", "/run", (), b"first", WAIT)
        assert await first.read() == b"ok"
        with pytest.raises(UpstreamError):
            await client.request(server.url, "POST", "/run", (), b"second", WAIT)
    assert received == [b"first", b"second"]  # the second POST went out once


async def test_the_deadline_covers_waiting_for_a_free_connection(servers, clients):
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        async with asyncio.timeout(WAIT):
            await release.wait()
        return web.Response(text="late")

    url = await servers.web(("GET", "/slow", slow))
    client = clients(max_connections=1)
    holder = asyncio.create_task(get(client, url, "/slow", deadline=WAIT))
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(UpstreamTimeout):
            # The only connection is busy: the wait for it counts against the 0.2 s.
            await get(client, url, "/slow", deadline=0.2)
        assert loop.time() - started < 1.0
    finally:
        release.set()
        response = await holder
        await response.read()
