"""The gateway's lean HTTP/1.1 connection (serving/h1.py), which serves the proxied routes, and its
hand-off to aiohttp's server for everything else. The rest of the suite runs through it too (it is
on by default); these tests pin what only it does: requests split or pipelined across reads, the
move to aiohttp in the middle of a connection, and answers equal to aiohttp's own."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from modelyard.errors import ConfigError
from modelyard.serving.h1 import MAX_WAITING_BYTES
from raw_http import TIMEOUT, Client, Reply, closed_by_server, read_reply, request
from support import model_config, wait_until

CHAT = "/v1/chat/completions"
CHAT_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}]})
INFER_BODY = orjson.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]})
STREAM_BODY = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "a b c"}]})
# Differ between two servers by nature: the clock, the server's name, the request id and the
# backend the strategy picked.
VARYING = {"date", "server", "x-request-id", "x-modelyard-backend", "content-length"}


@pytest.fixture
async def pair(sim_workers, gateways):
    """Two gateways over the same sim worker: the lean connection on, and aiohttp only."""
    workers = await sim_workers(1)
    models = [model_config("m", workers)]
    lean = await gateways(models, listen={"host": "127.0.0.1", "port": 0})
    plain = await gateways(models, listen={"host": "127.0.0.1", "port": 0, "lean": False})
    return lean, plain


async def test_pipelined_requests_are_answered_in_order_even_across_the_hand_off(pair, clients):
    lean, _ = pair
    client = await clients(lean.url)
    infer = request("POST", "/v2/models/m/infer", INFER_BODY)
    models = request("GET", "/v1/models")
    # One write: two proxied requests, then one for aiohttp, then a proxied one again.
    await client.send(request("POST", CHAT, CHAT_BODY) + infer + models + request("POST", CHAT, CHAT_BODY))
    replies = [await read_reply(client.reader) for _ in range(4)]
    assert [r.status for r in replies] == [200, 200, 200, 200], [r.body for r in replies]
    assert replies[0].json()["object"] == "chat.completion"
    assert replies[1].json()["model_name"] == "m"
    assert replies[2].json()["object"] == "list"
    assert replies[3].json()["object"] == "chat.completion"
    assert not any(r.closes for r in replies)


async def test_a_head_and_body_split_over_many_reads_are_read_whole(pair, clients):
    lean, _ = pair
    client = await clients(lean.url)
    data = request("POST", CHAT, CHAT_BODY)
    for i in range(0, len(data), 7):  # the blank line that ends the head straddles two writes
        await client.send(data[i : i + 7])
        await asyncio.sleep(0)
    reply = await read_reply(client.reader)
    assert reply.status == 200 and reply.json()["object"] == "chat.completion"
    again = await client.exchange(b"\r\n" + data)  # an empty line before a request is allowed
    assert again.status == 200


async def test_requests_the_lean_connection_does_not_take_are_served_by_aiohttp(pair, clients):
    lean, _ = pair
    chunked = (
        f"POST {CHAT} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT_BODY), CHAT_BODY)
    client = await clients(lean.url)
    reply = await client.exchange(chunked)
    assert reply.status == 200 and reply.json()["object"] == "chat.completion"

    client = await clients(lean.url)  # curl sends Expect: 100-continue with a large body
    head = request("POST", CHAT, b"", Expect="100-continue")
    await client.send(head.replace(b"Content-Length: 0", b"Content-Length: %d" % len(CHAT_BODY)))
    continued = await read_reply(client.reader)
    assert continued.status == 100
    await client.send(CHAT_BODY)
    assert (await read_reply(client.reader)).status == 200

    client = await clients(lean.url)  # HTTP/1.0: no keep-alive unless asked
    await client.send(request("POST", CHAT, CHAT_BODY).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    reply = await read_reply(client.reader)
    assert reply.status == 200
    assert await closed_by_server(client.reader)


async def test_connection_close_is_honoured(pair, clients):
    lean, _ = pair
    client = await clients(lean.url)
    reply = await client.exchange(request("POST", CHAT, CHAT_BODY, Connection="close"))
    assert reply.status == 200 and reply.closes
    assert await closed_by_server(client.reader)


async def test_a_body_over_the_limit_is_413_before_it_is_sent(sim_workers, gateways, clients):
    workers = await sim_workers(1)
    gateway = await gateways([model_config("m", workers)], limits={"max_body_bytes": 1000})
    client = await clients(gateway.url)
    head = request("POST", CHAT, b"").replace(b"Content-Length: 0", b"Content-Length: 5000")
    reply = await client.exchange(head)  # no body sent: the answer cannot wait for it
    assert reply.status == 413
    assert "limits.max_body_bytes (1000 bytes)" in reply.json()["error"]["message"]


def chat_body(max_tokens: int) -> bytes:
    return orjson.dumps(
        {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    )


async def _true(value: bool) -> bool:  # wait_until takes a coroutine
    return value


def _comparable(reply: Reply) -> tuple[int, dict[str, str], Any]:
    headers = {k: v for k, v in reply.headers.items() if k not in VARYING}
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e.removeprefix(b"data: ") for e in reply.body.split(b"\n\n") if e]
        return reply.status, headers, [_without_ids(e) for e in events]
    return reply.status, headers, _without_ids(reply.body)


def _without_ids(data: bytes) -> Any:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if isinstance(body, dict):
        body.pop("id", None)
        body.pop("created", None)
    return body


@pytest.mark.parametrize(
    ("method", "path", "body", "headers"),
    [
        ("POST", CHAT, CHAT_BODY, {}),
        ("POST", CHAT, CHAT_BODY, {"X-Request-Id": "given-id"}),
        ("POST", CHAT, b"{not json", {}),
        ("POST", CHAT, orjson.dumps({"model": "nope", "messages": []}), {}),
        ("POST", "/v1/completions", orjson.dumps({"model": "m", "prompt": "hi"}), {}),
        ("POST", "/v1/embeddings", orjson.dumps({"model": "m", "input": "hi"}), {}),
        ("POST", "/v2/models/m/infer", INFER_BODY, {}),
        ("POST", "/v2/models/m/versions/1/infer", INFER_BODY, {}),
        ("POST", "/v2/models/nope/infer", INFER_BODY, {}),
        ("POST", "/v2/models/m/infer", b'{"inputs": 3}', {}),
        ("POST", "/v1/models/m:predict", orjson.dumps({"instances": [[1, 2]]}), {}),
        ("GET", "/v2/models/m", b"", {}),
        ("GET", "/v2/models/m/ready", b"", {}),
        ("GET", "/v1/models/m", b"", {}),
        ("GET", "/v2/models/nope", b"", {}),
        ("POST", "/v2/models/m/infer/", INFER_BODY, {}),
        ("POST", "/v2/models//infer", INFER_BODY, {}),
        ("PUT", "/v2/models/m/infer", INFER_BODY, {}),
        ("POST", "/v2/models/m%2F..%2Fx/infer", INFER_BODY, {}),
        ("POST", CHAT + "?x=1", CHAT_BODY, {}),
        ("POST", CHAT, STREAM_BODY, {}),
    ],
)
async def test_lean_and_aiohttp_answer_alike(pair, clients, method, path, body, headers):
    lean, plain = pair
    replies = []
    for gateway in (lean, plain):
        client = await clients(gateway.url)
        replies.append(await client.exchange(request(method, path, body, **headers)))
    assert _comparable(replies[0]) == _comparable(replies[1])


async def test_keepalive_timeout_closes_idle_connections_not_busy_ones(sim_workers, gateways, clients):
    # A chat answer of 16 tokens at 40 ms a token takes about 0.64 s, longer than the keep-alive.
    workers = await sim_workers(1, decode_ms_per_token=40.0)
    listen = {"host": "127.0.0.1", "port": 0, "keepalive_timeout": 0.3}
    gateway = await gateways([model_config("m", workers)], listen=listen)
    body = orjson.dumps({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
    client = await clients(gateway.url)
    started = time.monotonic()
    reply = await client.exchange(request("POST", CHAT, body))
    assert reply.status == 200 and time.monotonic() - started > 0.3  # answered, not cut off
    idle_from = time.monotonic()
    assert await closed_by_server(client.reader)
    assert 0.25 < time.monotonic() - idle_from < 5


# --- found in review: each of these once broke the lean connection --------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"\n\r\n\r\nGET /v2/models/m/ready HTTP/1.1\r\nHost: t\r\n\r\n",  # blank lines, bare LFs too
        b"GET /v2/models/m HTTP/1.1\r\nHost: x\n\r\n",  # a bare LF ends the last header
        b"GET /v2/models/m HTTP/1.1\n\r\n",
        b"GET /v2/models/m#frag HTTP/1.1\r\nHost: t\r\n\r\n",  # a fragment is not part of the path
        b"GET /v1/models/m#x HTTP/1.1\r\nHost: t\r\n\r\n",
        b"GET /v2/models/m/ready HTTP/1.1\r\n\r\n",  # no Host: 400 (RFC 9112 3.2)
        b"GET /v2/models/m/ready HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: a\r\nContent-Type: a/b\r\nContent-Type: c/d\r\n"
        b"Content-Length: 2\r\n\r\n{}",
    ],
)
async def test_odd_heads_are_answered_as_aiohttp_answers_them(pair, clients, raw):
    replies = []
    for gateway in pair:
        client = await clients(gateway.url)
        await client.send(raw)
        replies.append(await read_reply(client.reader))
    assert _comparable(replies[0]) == _comparable(replies[1])


async def test_blank_lines_split_across_reads_before_a_request(pair, clients):
    lean, _ = pair
    client = await clients(lean.url)
    assert (await client.exchange(request("GET", "/v2/models/m/ready"))).status == 200
    for part in (b"\r", b"\n\r\n", request("GET", "/v2/models/m/ready")):
        await client.send(part)
        await asyncio.sleep(0)
    assert (await read_reply(client.reader)).status == 200


async def test_a_client_that_does_not_read_stops_the_requests_behind_it(sim_workers, gateways, clients):
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])])
    body = chat_body(max_tokens=100_000)  # about 600 KB of answer each
    client = await clients(gateway.url)
    for _ in range(30):  # one request every 20 ms on one connection, none of the answers read yet
        await client.send(request("POST", CHAT, body))
        await asyncio.sleep(0.02)
        assert worker.stats.requests_total <= 10  # the unread answers hold back the rest
    replies = [await read_reply(client.reader) for _ in range(30)]  # then all come, in order
    assert [r.status for r in replies] == [200] * 30
    assert worker.stats.requests_total == 30


async def test_a_request_pipelined_behind_one_answered_at_stop_is_not_served(sim_workers, gateways, clients):
    workers = await sim_workers(1, decode_ms_per_token=40.0)
    gateway = await gateways([model_config("m", workers)], listen={"host": "127.0.0.1", "port": 0})
    slow = chat_body(max_tokens=8)
    client = await clients(gateway.url)
    await client.send(request("POST", CHAT, slow) + request("GET", "/v1/models"))
    await wait_until(lambda: _true(workers[0].stats.running == 1))
    await gateway.stop()  # the answer in flight completes; the request behind it meets a closed door
    reply = await read_reply(client.reader)
    assert reply.status == 200 and reply.closes
    assert await closed_by_server(client.reader)


async def test_an_answer_in_flight_at_stop_is_sent_whole(sim_workers, gateways):
    (worker,) = await sim_workers(1)
    listen = {"host": "127.0.0.1", "port": 0, "shutdown_timeout": 0.3}
    limits = {"max_body_bytes": 32 * 1024 * 1024}
    gateway = await gateways([model_config("m", [worker])], listen=listen, limits=limits)
    count = 1_500_000  # the sim worker echoes the input: about 15 MB each way
    tensor = {"name": "x", "shape": [count], "datatype": "FP32", "data": [1.2345678] * count}
    client = await Client.connect(gateway.url, receive_buffer=4096)  # what it leaves unread stays put
    try:
        await client.send(request("POST", "/v2/models/m/infer", orjson.dumps({"inputs": [tensor]})))
        async with asyncio.timeout(TIMEOUT):
            first = await client.reader.readexactly(12)  # the answer has begun: most of it is unsent
            await gateway.stop()
            rest = await client.reader.read()  # read only now, after the stop, to the close
    finally:
        client.close()
    head, _, body = (first + rest).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    assert len(body) == length > 10_000_000
    assert len(orjson.loads(body)["outputs"][0]["data"]) == count


async def test_a_head_handed_off_late_does_not_shorten_the_next_heads_deadline(
    sim_workers, gateways, clients
):
    workers = await sim_workers(1)
    listen = {"host": "127.0.0.1", "port": 0, "header_timeout": 1.0}
    gateway = await gateways([model_config("m", workers)], listen=listen)
    client = await clients(gateway.url)
    pads = {f"X-Pad-{i}": "p" * 7000 for i in range(11)}  # each under 8 KiB, 77 KB in all
    head = request("GET", "/v2/models/m", **pads)
    await client.send(head[:40_000])
    await asyncio.sleep(0.6)  # a slow client: part of the head's second is spent before the hand-off
    await client.send(head[40_000:70_000])  # past what the lean connection reads of a head: aiohttp's
    await asyncio.sleep(0.05)  # (not in the same read as the rest)
    await client.send(head[70_000:])
    reply = await read_reply(client.reader)
    assert reply.status == 200 and "aiohttp" in reply.headers["server"]  # aiohttp answered it
    second = request("GET", "/v2/models/m")
    await client.send(second[:10])
    await asyncio.sleep(0.6)  # within the next head's own second
    await client.send(second[10:])
    assert (await read_reply(client.reader)).status == 200


@pytest.mark.parametrize("lean", [True, False])
async def test_keepalive_timeout_0_keeps_connections_open(sim_workers, gateways, clients, lean):
    workers = await sim_workers(1)
    listen = {"host": "127.0.0.1", "port": 0, "keepalive_timeout": 0, "lean": lean}
    gateway = await gateways([model_config("m", workers)], listen=listen)
    client = await clients(gateway.url)
    for path in ("/v2/models/m/ready", "/v1/models", "/v1/models"):
        reply = await client.exchange(request("GET", path))
        assert reply.status == 200 and not reply.closes


@contextlib.asynccontextmanager
async def chat_backend(answer: Any) -> AsyncIterator[str]:
    """An aiohttp server answering the chat route with `answer` (and /health 200): its base URL."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"healthy": True})

    app = web.Application()
    app.router.add_post(CHAT, answer)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_a_204_answer_has_no_content_length(gateways, clients):
    async def no_content(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=204)

    async with chat_backend(no_content) as url:
        models = [{"name": "m", "endpoints": [{"url": url}]}]
        replies = []
        for lean in (True, False):
            gateway = await gateways(models, listen={"host": "127.0.0.1", "port": 0, "lean": lean})
            client = await clients(gateway.url)
            replies.append(await client.exchange(request("POST", CHAT, CHAT_BODY)))
    assert [r.status for r in replies] == [204, 204]
    assert ["content-length" in r.headers for r in replies] == [False, False]  # RFC 9110 8.6


async def test_pipelined_bytes_waiting_behind_an_answer_are_bounded(sim_workers, gateways):
    workers = await sim_workers(1)
    gateway = await gateways([model_config("m", workers)])
    client = await Client.connect(gateway.url, receive_buffer=4096)
    try:
        data = request("GET", "/v2/models/m/ready") * 400_000  # about 19 MB, none of the answers read
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(2):
                await client.send(data)  # stalls once the server stops reading
        waiting = [c.waiting_bytes for c in gateway.server.lean_connections]
        assert waiting and max(waiting) <= 2 * MAX_WAITING_BYTES
    finally:
        client.close()


async def test_a_head_timeout_on_an_unreadable_target_is_answered_and_closed(sim_workers, gateways, clients):
    workers = await sim_workers(1)
    listen = {"host": "127.0.0.1", "port": 0, "header_timeout": 0.2}
    gateway = await gateways([model_config("m", workers)], listen=listen)
    client = await clients(gateway.url)
    await client.send(b"GET http://[x/ HTTP/1.1\r\nHost: a\r\n")  # and the head never ends
    reply = await read_reply(client.reader)
    assert reply.status == 408 and reply.json()["error"]["code"] == "header_timeout"  # the plain envelope
    assert await closed_by_server(client.reader)


@pytest.mark.parametrize("lean", [True, False])
async def test_without_a_header_timeout_the_keepalive_timeout_closes_silent_connections(
    sim_workers, gateways, clients, lean
):
    workers = await sim_workers(1)
    listen = {"host": "127.0.0.1", "port": 0, "header_timeout": 0, "keepalive_timeout": 0.3, "lean": lean}
    gateway = await gateways([model_config("m", workers)], listen=listen)
    silent = await clients(gateway.url)
    started = time.monotonic()
    assert await closed_by_server(silent.reader)
    assert time.monotonic() - started < 5


async def test_stop_closes_idle_aiohttp_connections_at_once_while_lean_answers_finish(
    sim_workers, gateways, clients
):
    workers = await sim_workers(1, decode_ms_per_token=40.0)
    listen = {"host": "127.0.0.1", "port": 0, "shutdown_timeout": 10}
    gateway = await gateways([model_config("m", workers)], listen=listen)
    idle = await clients(gateway.url)
    assert (await idle.exchange(request("GET", "/v1/models"))).status == 200  # now aiohttp's, idle
    busy = await clients(gateway.url)
    await busy.send(request("POST", CHAT, chat_body(max_tokens=16)))  # about 0.64 s of answer
    await wait_until(lambda: _true(workers[0].stats.running == 1))
    stopping = asyncio.create_task(gateway.stop())
    assert await closed_by_server(idle.reader)
    assert workers[0].stats.running == 1  # closed while the lean answer is still being made
    reply = await read_reply(busy.reader)
    assert reply.status == 200 and reply.closes
    await stopping


async def test_a_servers_own_gateway_headers_are_replaced_not_doubled(gateways, http):
    """The lean connection relays a server's header fields as the bytes that came; the fields the
    gateway sets replace the server's, hop-by-hop ones are dropped, repeats and non-ASCII kept."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        response = web.json_response({"object": "chat.completion"})
        for name, value in [
            ("X-Request-Id", "the-servers-own"),
            ("X-Modelyard-Backend", "not-the-gateways"),
            ("Connection", "X-Hop-Only"),
            ("X-Hop-Only", "dropped"),
            ("X-Note", "café"),
        ]:
            response.headers[name] = value
        response.headers.add("Set-Cookie", "a=1")
        response.headers.add("Set-Cookie", "b=2")
        return response

    async with chat_backend(answer) as url:
        models = [{"name": "m", "endpoints": [{"name": "e0", "url": url}]}]
        for lean in (True, False):
            gateway = await gateways(models, listen={"host": "127.0.0.1", "port": 0, "lean": lean})
            sent = {"X-Request-Id": "the-clients"}
            async with http.post(gateway.url + CHAT, data=CHAT_BODY, headers=sent) as response:
                assert response.status == 200
                headers = response.headers
            assert headers.getall("X-Request-Id") == ["the-clients"], lean
            assert headers.getall("X-Modelyard-Backend") == ["e0"], lean
            assert headers.getall("Set-Cookie") == ["a=1", "b=2"], lean
            assert headers["X-Note"] == "café", lean
            assert "X-Hop-Only" not in headers, lean


async def test_the_backend_gets_the_clients_fields_less_hop_by_hop_ones_on_both_listeners(gateways):
    """The lean connection sorts a request's fields by what their names mean, worked out once for
    each sequence of names; what reaches the server is what aiohttp's listener forwards: no
    hop-by-hop field (nor one a Connection field lists, Close included), no Host or Content-Length
    of the client's, the client's X-Request-Id once, every other field in its order and as the
    bytes that came. A head with the same names and other values is read by its own values."""
    seen: list[list[tuple[bytes, bytes]]] = []

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.append(list(request.raw_headers))
        return web.json_response({"object": "chat.completion"})

    first = (
        b"Connection: keep-alive, X-Hop-Req\r\nX-Hop-Req: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n"
        b"X-Request-Id: the-clients\r\nx-custom: a\r\nX-Custom: b\r\nX-Latin: \xe9t\xe9\r\n"
        b"Authorization: Bearer k\r\n"
    )
    # the same names: X-Hop-Req is not listed this time, so it goes on
    second = first.replace(b"keep-alive, X-Hop-Req", b"keep-alive").replace(b"X-Hop-Req: 1", b"X-Hop-Req: 2")
    last = b"Connection: close\r\nClose: 1\r\nX-Request-Id: the-last\r\n"
    head = b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    start = head % (CHAT.encode(), len(CHAT_BODY))
    async with chat_backend(answer) as url:
        models = [{"name": "m", "endpoints": [{"name": "e0", "url": url}]}]
        for lean in (True, False):
            gateway = await gateways(models, listen={"host": "127.0.0.1", "port": 0, "lean": lean})
            for fields in ((first, second), (last,)):  # two on one connection, then one that closes it
                client = await Client.connect(gateway.url)
                try:
                    for one in fields:
                        reply = await client.exchange(start + one + b"\r\n" + CHAT_BODY)
                        assert reply.status == 200, lean
                        # (aiohttp's server names itself; the lean connection's answers do not)
                        assert ("aiohttp" in reply.headers.get("server", "")) is not lean
                finally:
                    client.close()
    lean_seen, aiohttp_seen = seen[:3], seen[3:]
    lean_fields = lean_seen[0]
    names = [name.lower() for name, _ in lean_fields]
    for hop in (b"connection", b"x-hop-req", b"keep-alive", b"te"):
        assert hop not in names
    assert names.count(b"x-request-id") == 1
    assert (b"X-Request-Id", b"the-clients") in lean_fields
    custom = [field for field in lean_fields if field[0].lower() == b"x-custom"]
    assert custom == [(b"x-custom", b"a"), (b"X-Custom", b"b")]
    assert (b"X-Latin", b"\xe9t\xe9") in lean_fields
    assert (b"Authorization", b"Bearer k") in lean_fields
    assert (b"Content-Type", b"application/json") in lean_fields
    assert names.count(b"host") == 1 and (b"Host", b"test") not in lean_fields  # the backend's own
    assert (b"X-Hop-Req", b"2") in lean_seen[1]
    assert b"close" not in [name.lower() for name, _ in lean_seen[2]]
    assert (b"X-Request-Id", b"the-last") in lean_seen[2]
    # aiohttp's listener forwards the same fields (the client in front of the backend adds its own)
    client_set = {b"host", b"content-length", b"accept", b"accept-encoding", b"user-agent"}

    def own(fields: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [f for f in fields if f[0].lower() not in client_set]

    assert [own(f) for f in lean_seen] == [own(f) for f in aiohttp_seen]


async def test_an_endpoint_name_no_header_may_hold_is_refused_before_the_gateway_starts(gateways):
    """Its name goes in X-Modelyard-Backend: a CR or LF there would break the answer's head (or,
    past the config, leave the try's slot taken: the proxy ends the try with 500 first)."""
    endpoint = {"name": "e\r\nX-Injected: 1", "url": "http://127.0.0.1:9"}
    with pytest.raises(ConfigError, match=r"models\[0\]\.endpoints\[0\]\.name: may not hold control"):
        await gateways([{"name": "m", "endpoints": [endpoint]}])


async def test_request_targets_are_routed_by_method_path_and_model_after_the_first(
    sim_workers, gateways, clients
):
    """Requests to fixed and to model-naming paths, repeated on one connection (the lean connection
    remembers where a fixed path's method and URL go), each reach their own route and model; the
    same path with another method is not the lean connection's, then or later."""
    workers = await sim_workers(1)
    gateway = await gateways(
        [model_config("a", workers), model_config("b", workers)], listen={"host": "127.0.0.1", "port": 0}
    )
    client = await clients(gateway.url)
    for model in ("a", "b", "a", "b"):
        reply = await client.exchange(request("POST", f"/v2/models/{model}/infer", INFER_BODY))
        assert reply.status == 200 and reply.json()["model_name"] == model
        assert "server" not in reply.headers  # (the lean connection answered)
    for path in (CHAT, CHAT, CHAT + "?trace=1"):
        body = orjson.dumps({"model": "b", "messages": [{"role": "user", "content": "hi"}]})
        reply = await client.exchange(request("POST", path, body))
        assert reply.status == 200 and reply.json()["object"] == "chat.completion"
        assert "server" not in reply.headers
    other = await clients(gateway.url)
    reply = await other.exchange(request("GET", CHAT))
    assert reply.status == 405 and "aiohttp" in reply.headers["server"]
