"""The floor of a Python reverse proxy: what uvloop + httptools can do with no features at all.

Not part of modelyard. A measuring stick for issue 11 (benchmarks/README.md): the least work a
Python proxy can do per request, to tell how much of the gateway's cost is its features and how
much is the language. Round robin over the endpoints of the first model in a modelyard config, one
keep-alive connection pool per backend, everything in protocol callbacks (no task, coroutine or
future per request). No retries, timeouts, health checks, metrics, routing, limits or error
handling worth the name: a backend that fails closes the client's connection.

    .venv/bin/python benchmarks/python_floor.py -c gateway.yaml [--workers N]

As an overhead.py target:

    .venv/bin/python benchmarks/overhead.py --targets vllm-router,modelyard \\
        --variant 'floor=.venv/bin/python benchmarks/python_floor.py -c {config}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools
import uvloop
import yaml

# Hop-by-hop fields, and the framing the proxy sets itself.
_DROPPED = frozenset({b"host", b"connection", b"keep-alive", b"content-length", b"transfer-encoding"})
ASYNC = False  # --style async: a task per request awaiting a future for the answer
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}


class Backend:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.host_header = f"{host}:{port}".encode()
        self.idle: list[Upstream] = []


class Upstream(asyncio.Protocol):
    """One keep-alive connection to a backend; one exchange at a time."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: Client | None = None
        self.fields: list[bytes] = []
        self.body: list[bytes] = []
        self.waiter: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.fail()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.backend.idle:
            self.backend.idle.remove(self)
        self.fail()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _DROPPED:
            self.fields.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        status = self.parser.get_status_code()
        body = b"".join(self.body)
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))
        answer = head + b"".join(self.fields) + b"Content-Length: %d\r\n\r\n" % len(body) + body
        self.fields, self.body = [], []
        self.backend.idle.append(self)
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.set_result(answer)
        elif client is not None:
            client.answer(answer)

    def send(self, client: Client, payload: bytes) -> None:
        assert self.transport is not None
        self.client = client
        self.transport.write(payload)

    def fail(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()
        if self.transport is not None:
            self.transport.close()


class Client(asyncio.Protocol):
    """One client connection; requests answered in order, one at a time."""

    def __init__(self, pick: Callable[[], Backend]) -> None:
        self.pick = pick
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.fields: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _DROPPED:
            self.fields.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        backend = self.pick()
        body = b"".join(self.body)
        method = self.parser.get_method()
        payload = (
            method + b" " + self.url + b" HTTP/1.1\r\nHost: " + backend.host_header + b"\r\n"
            + b"".join(self.fields) + b"Content-Length: %d\r\n\r\n" % len(body) + body
        )  # fmt: skip
        self.url, self.fields, self.body = b"", [], []
        if ASYNC:
            self.loop.create_task(self.exchange(backend, payload))
        elif backend.idle:
            backend.idle.pop().send(self, payload)
        else:
            self.loop.create_task(self.connect(backend, payload))

    async def exchange(self, backend: Backend, payload: bytes) -> None:
        """The same exchange as a task awaiting a future (the shape of an async gateway)."""
        if backend.idle:
            upstream = backend.idle.pop()
        else:
            _, upstream = await self.loop.create_connection(
                lambda: Upstream(backend), backend.host, backend.port
            )
        waiter = self.loop.create_future()
        upstream.waiter = waiter
        upstream.send(self, payload)
        self.answer(await waiter)

    async def connect(self, backend: Backend, payload: bytes) -> None:
        try:
            _, upstream = await self.loop.create_connection(
                lambda: Upstream(backend), backend.host, backend.port
            )
        except OSError:
            self.close()
            return
        upstream.send(self, payload)

    def answer(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def backends_from(config: str) -> tuple[str, int, list[Backend]]:
    with open(config) as f:
        data = yaml.safe_load(f)
    listen = data.get("listen", {})
    backends = []
    for endpoint in data["models"][0]["endpoints"]:
        parts = urlsplit(endpoint["url"])
        backends.append(Backend(parts.hostname or "127.0.0.1", parts.port or 80))
    return listen.get("host", "127.0.0.1"), int(listen.get("port", 8000)), backends


async def serve(host: str, port: int, backends: list[Backend]) -> None:
    turn = 0

    def pick() -> Backend:
        nonlocal turn
        turn += 1
        return backends[turn % len(backends)]

    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(pick), host, port, reuse_port=True, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True, help="a modelyard gateway YAML (listen, models[0])")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (SO_REUSEPORT)")
    parser.add_argument("--log-level", help="ignored (overhead.py passes it)")
    parser.add_argument("--style", choices=("callbacks", "async"), default="callbacks")
    args = parser.parse_args()
    global ASYNC
    ASYNC = args.style == "async"
    host, port, _ = backends_from(args.config)
    children = []
    for _ in range(args.workers - 1):
        pid = os.fork()
        if pid == 0:
            break
        children.append(pid)
    # Each process its own backends and pools (no state shared, like modelyard's workers).
    _, _, backends = backends_from(args.config)
    if children:  # the parent: overhead.py stops it alone, so it stops the others

        def stop(*_: object) -> None:
            for pid in children:
                os.kill(pid, signal.SIGTERM)
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, stop)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(host, port, backends))


if __name__ == "__main__":
    main()
