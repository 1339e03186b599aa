"""The gateway's lean HTTP/1.1 connection (serving/h1.py), which serves the proxied routes, and its
hand-off to aiohttp's server for everything else. The rest of the suite runs through it too (it is
on by default); these tests pin what only it does: requests split or pipelined across reads, the
move to aiohttp in the middle of a connection, and answers equal to aiohttp's own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from raw_http import Client, Reply, closed_by_server, read_reply, request
from support import model_config

CHAT = "/v1/chat/completions"
CHAT_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}]})
INFER_BODY = orjson.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]})
STREAM_BODY = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "a b c"}]})
# Differ between two servers by nature: the clock, the server's name, the request id and the
# backend the strategy picked.
VARYING = {"date", "server", "x-request-id", "x-modelyard-backend", "content-length"}


@pytest.fixture
async def clients():
    opened: list[Client] = []

    async def connect(url: str) -> Client:
        client = await Client.connect(url)
        opened.append(client)
        return client

    yield connect
    for client in opened:
        client.close()


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
