"""The client-facing listener of every modelyard server (modelyard.serving): a deadline on request
heads, a bound on open connections, the error envelope for heads that cannot be taken, and the
drain on SIGTERM. Real servers on loopback; raw sockets where a client must misbehave."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict

from modelyard.config import ListenConfig
from modelyard.graph import GraphDocument, parse_graph
from modelyard.graphrouter import start_router
from modelyard.serving import HttpServer, serve_until_signal
from modelyard.serving.server import MAX_HEADERS
from raw_http import Client, Reply, closed_by_server, read_reply, request
from support import free_ports, metric_value, model_config, wait_until

CHAT = "/v1/chat/completions"
CHAT_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}]})
TIMEOUT = 30  # bound on every wait below; a healthy run takes a fraction of it


def listen(**fields: Any) -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": 0, **fields}


@pytest.fixture
async def gateway_with(sim_workers, gateways):
    """`await gateway_with(**listen_fields)`: a gateway over one sim worker serving model `m`."""

    async def start(**fields: Any):
        workers = await sim_workers(1)
        return await gateways([model_config("m", workers)], listen=listen(**fields))

    return start


# --- the header deadline (slowloris) ---------------------------------------------------------------


async def test_slow_request_heads_get_408_and_are_closed(gateway_with, clients, http):
    gateway = await gateway_with(header_timeout=0.2)
    slow = []
    for _ in range(50):
        # Each sends the start of its head as soon as it is connected: a connection that has sent
        # nothing when its header_timeout ends is closed without an answer (the test below), and
        # connecting all 50 first can take longer than 0.2 s on a busy machine.
        client = await clients(gateway.url)
        await client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        slow.append(client)

    async def trickle() -> None:  # a header byte now and then, as slowloris sends them
        for _ in range(40):
            for client in slow:
                if not client.writer.is_closing():
                    client.writer.write(b"X")
            await asyncio.sleep(0.05)

    trickling = asyncio.create_task(trickle())
    started = time.monotonic()
    try:
        replies = [await read_reply(client.reader) for client in slow]
    finally:
        trickling.cancel()
    assert time.monotonic() - started < 1.5  # 0.2 s each, all at once; not the keep-alive's 75 s
    for reply in replies:
        assert reply.status == 408 and reply.closes
        error = reply.json()["error"]  # the OpenAI envelope: the request line named /v1/chat/...
        assert error["code"] == "header_timeout" and "listen.header_timeout (0.2s)" in error["message"]
    for client in slow:
        assert await closed_by_server(client.reader)
    assert await metric_value(http, gateway.url, "modelyard_header_timeouts_total") == 50


async def test_a_connection_that_sends_nothing_is_closed_silently(gateway_with, clients):
    gateway = await gateway_with(header_timeout=0.2)
    client = await clients(gateway.url)
    started = time.monotonic()
    async with asyncio.timeout(TIMEOUT):
        assert await client.reader.read() == b""  # no 408: there was no request to answer
    assert time.monotonic() - started < 5


async def test_keep_alive_times_each_head_from_its_first_byte(gateway_with, clients):
    gateway = await gateway_with(header_timeout=0.2, keepalive_timeout=30)
    client = await clients(gateway.url)
    assert (await client.exchange(request("GET", "/v1/models"))).status == 200
    # Idle between requests is keepalive_timeout's business: this pause, longer than the header
    # timeout, is the behaviour under test.
    await asyncio.sleep(0.4)
    assert (await client.exchange(request("GET", "/v1/models"))).status == 200
    await client.send(b"GET /v2/health/ready HTTP/1.1\r\nHost")  # a head that never ends
    reply = await read_reply(client.reader)
    assert reply.status == 408 and reply.json() == {
        "error": "the request head was not complete within listen.header_timeout (0.2s)"
    }  # the OIP envelope: the request line was /v2/...
    assert await closed_by_server(client.reader)


async def test_a_slow_body_is_not_a_slow_head(gateway_with, clients):
    gateway = await gateway_with(header_timeout=0.2)
    client = await clients(gateway.url)
    head = request("POST", CHAT, CHAT_BODY)
    split = head.index(b"\r\n\r\n") + 4
    await client.send(head[:split])
    for i in range(0, len(CHAT_BODY), 16):  # the body over ~0.5 s, longer than the header timeout
        await client.send(head[split + i : split + i + 16])
        await asyncio.sleep(0.5 * 16 / len(CHAT_BODY))
    reply = await read_reply(client.reader)
    assert reply.status == 200, reply.body
    assert reply.json()["object"] == "chat.completion"


# --- the bound on open connections ---------------------------------------------------------------


async def test_connections_over_max_connections_get_503_with_retry_after(gateway_with, clients, http):
    gateway = await gateway_with(max_connections=4)
    held = [await clients(gateway.url) for _ in range(4)]
    for client in held:  # each one accepted and served
        assert (await client.exchange(request("GET", "/healthz"))).status == 200
    extra = await clients(gateway.url)
    reply = await extra.exchange(request("GET", "/v2/health/ready"))
    assert reply.status == 503 and reply.closes
    assert reply.headers["retry-after"] == "1"
    assert reply.json() == {"error": "too many connections to this server; retry shortly"}  # OIP path
    assert await closed_by_server(extra.reader)
    other = await clients(gateway.url)
    reply = await other.exchange(request("GET", "/healthz"))
    assert reply.status == 503 and reply.json()["error"]["code"] == "too_many_connections"

    held.pop().close()  # room again: the next connection is served
    held.pop().close()

    async def closed() -> bool:  # the server has seen both go
        return gateway.server.stats.open_connections == 2

    await wait_until(closed)
    assert await metric_value(http, gateway.url, "modelyard_connections_refused_total") == 2
    assert await metric_value(http, gateway.url, "modelyard_connections_open") == 3  # 2 held + this one


# --- heads that cannot be taken ------------------------------------------------------------------

BIG_HEADER = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n"
MANY_HEADERS = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: 1\r\n" % i for i in range(10_000))
    + b"\r\n"
)
LONG_LINE = b"GET /v1/" + b"a" * 65536 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
# Within the lean connection's 64 KiB head, over aiohttp's limits: the lean connection finds them
# over once the head is complete, and hands them to aiohttp, which refuses them.
FIELD_OVER_LIMIT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"
FIELDS_OVER_LIMIT = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: 1\r\n" % i for i in range(MAX_HEADERS))  # with Host, one too many
    + b"\r\n"
)


@pytest.mark.parametrize(
    ("raw", "status", "envelope"),
    [
        (BIG_HEADER, 431, "oip"),
        (MANY_HEADERS, 431, "openai"),
        (LONG_LINE, 431, "openai"),  # the request line was not readable: the plain envelope
        (FIELD_OVER_LIMIT, 431, "openai"),
        (FIELDS_OVER_LIMIT, 431, "openai"),
        (b"GET /v2/models/m HTTP/1.1\r\nHost x\r\n\r\n", 400, "oip"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "openai"),  # TLS on the HTTP port
    ],
    ids=[
        "64KiB-header",
        "10000-headers",
        "64KiB-request-line",
        "9000-byte-header",
        "one-header-too-many",
        "bad-header",
        "tls-hello",
    ],
)
async def test_refused_heads_get_the_envelope_and_one_warning(
    gateway_with, clients, http, caplog, raw, status, envelope
):
    gateway = await gateway_with()
    client = await clients(gateway.url)
    with caplog.at_level(logging.DEBUG):
        await client.send(raw)
        reply = await read_reply(client.reader)
        assert await closed_by_server(client.reader)
    assert reply.status == status
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    if envelope == "oip":
        assert isinstance(body["error"], str)
    else:
        code = "request_header_fields_too_large" if status == 431 else "malformed_request"
        assert body["error"]["code"] == code
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].name == "modelyard.serving" and records[0].exc_info is None
    assert f": {status} " in records[0].getMessage() and "\n" not in records[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)  # no traceback at any level
    refused = await metric_value(http, gateway.url, "modelyard_request_heads_refused_total", code=str(status))
    assert refused == 1


# --- the drain -------------------------------------------------------------------------------------


async def test_sigterm_drains_keep_alive_clients_then_exits(sim_workers, tmp_path: Path):
    """16 clients send request after request on their keep-alive connections when SIGTERM comes:
    every request is served, and once the drain begins each is told Connection: close (so it
    reconnects) before its connection goes; readiness is 503 for drain_seconds; then exit 0."""
    drain_seconds = 1.5
    workers = await sim_workers(1)
    (port,) = free_ports(1)
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": listen(port=port, drain_seconds=drain_seconds, shutdown_timeout=5),
                "models": [model_config("m", workers)],
            }
        )
    )
    process = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "modelyard", "serve", "-c", str(config), "--log-level", "warning"],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )
    held: list[Client] = []
    try:
        assert process.stdout is not None
        async with asyncio.timeout(TIMEOUT):
            line = (await process.stdout.readline()).decode()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line
        url = match.group(1)
        held = [await Client.connect(url) for _ in range(16)]
        served = [0] * len(held)
        all_busy = asyncio.Event()

        async def keep_sending(i: int, client: Client) -> None:
            """Request after request on one connection, until the server says it will close it."""
            for _ in range(5000):  # bounded; the drain starts within milliseconds of the signal
                reply = await client.exchange(request("POST", CHAT, CHAT_BODY))
                assert reply.status == 200, reply.body
                served[i] += 1
                if all(served):
                    all_busy.set()
                if reply.closes:
                    assert await closed_by_server(client.reader)
                    return
            raise AssertionError("never told Connection: close")

        sending = [asyncio.create_task(keep_sending(i, c)) for i, c in enumerate(held)]
        async with asyncio.timeout(TIMEOUT):
            await all_busy.wait()
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        async with asyncio.timeout(TIMEOUT):
            await asyncio.gather(*sending)

        async def readiness(path: str) -> Reply:
            fresh = await Client.connect(url)
            try:
                return await fresh.exchange(request("GET", path))
            finally:
                fresh.close()

        ready = await readiness("/readyz")  # the drain has begun: every client was told to close
        assert (ready.status, ready.closes, ready.json()["draining"]) == (503, True, True)
        assert (await readiness("/v2/health/ready")).status == 503
        assert (await readiness("/healthz")).status == 200  # alive all along
        late = await readiness("/v1/models")  # a new connection during the drain is still served
        assert (late.status, late.closes) == (200, True)

        async with asyncio.timeout(TIMEOUT):
            _, stderr = await process.communicate()
        exited = time.monotonic()
        assert process.returncode == 0, stderr.decode()
        assert exited - signalled >= drain_seconds
        assert "Traceback" not in stderr.decode()
    finally:
        for client in held:
            client.close()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_second_signal_ends_the_drain_at_once(clients):
    """serve_until_signal in this process: the first SIGTERM starts a 60 s drain, the second stops."""

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    server = HttpServer(app, ListenConfig(host="127.0.0.1", port=0, drain_seconds=60))
    await server.start()
    threshold = gc.get_threshold()
    serving = asyncio.create_task(serve_until_signal([server]))
    try:

        async def handlers_installed() -> bool:
            return signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL

        await wait_until(handlers_installed)
        os.kill(os.getpid(), signal.SIGTERM)

        async def drain_started() -> bool:
            return server.draining

        await wait_until(drain_started)
        client = await clients(server.url)
        reply = await client.exchange(request("GET", "/"))
        assert (reply.status, reply.body, reply.closes) == (200, b"hello", True)

        started = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(TIMEOUT):
            await serving
        assert time.monotonic() - started < 10  # not the 60 s drain
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers removed on the way out
    finally:
        serving.cancel()
        await server.stop()
        gc.unfreeze()  # serve_until_signal settled the collector for a server process, not pytest
        gc.set_threshold(*threshold)


async def test_the_graph_router_drains_the_same_way(sim_workers, clients):
    workers = await sim_workers(1)
    spec = {
        "nodes": {"root": {"routerType": "Sequence", "steps": [{"serviceUrl": workers[0].url + "/health"}]}}
    }
    graph, _ = parse_graph(GraphDocument("g", spec, "<test>"))
    router = await start_router(graph, host="127.0.0.1", port=0, mesh_probe_url=None)
    try:
        client = await clients(router.url)
        ready = await client.exchange(request("GET", "/readyz"))
        assert (ready.status, ready.closes) == (200, False)
        router.server.begin_drain()
        reply = await client.exchange(request("GET", "/readyz"))
        assert (reply.status, reply.body, reply.closes) == (503, b"shutting down\n", True)
        again = await clients(router.url)
        assert (await again.exchange(request("POST", "/", b"{}"))).closes
    finally:
        await router.stop()


async def test_a_hand_off_due_as_the_stop_begins_closes_the_connection(clients):
    """A lean answer that ends just after stop() began, with a request for aiohttp pipelined behind
    it: nothing may be handed to aiohttp's server, which is going; the connection closes."""
    resume = asyncio.get_running_loop().create_future()

    async def answered_then_waits(_request: Any, reply: Any) -> None:
        reply.whole(200, CIMultiDict(), b"ok")
        await resume  # as a stream's end waits for the client to take it

    async def other(_request: web.Request) -> web.Response:
        return web.Response(text="aiohttp")

    app = web.Application()
    app.router.add_get("/other", other)
    lean = {"/lean": (answered_then_waits, {})}
    server = HttpServer(app, ListenConfig(**listen(shutdown_timeout=2)), lean=lambda _m, path: lean.get(path))
    await server.start()
    client = await clients(server.url)
    await client.send(request("GET", "/lean") + request("GET", "/other"))
    assert (await read_reply(client.reader)).status == 200
    stopping = asyncio.create_task(server.stop())
    resume.set_result(None)  # the lean request ends right after stop's first step; /other comes due
    await stopping
    assert await closed_by_server(client.reader)
    assert server.stats.open_connections == 0
