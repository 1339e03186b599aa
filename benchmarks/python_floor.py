"""The floor of a Python reverse proxy: what uvloop + httptools can do with no features at all.

Not part of modelyard. A measuring stick (benchmarks/README.md, "Where the gap to vLLM's router
is"): the least work a Python proxy can do per request, to tell how much of the gateway's cost is
its own work and how much the event loop and HTTP parsing in Python. Round robin over the endpoints
of the first model in a modelyard config, one keep-alive connection pool per backend. By default
everything happens in protocol callbacks (no task, coroutine or future per request); `--style
async` gives each request a task that awaits a future for the answer, as the gateway does. No
retries, timeouts, health checks, metrics, routing, limits or error handling worth the name: a
backend that fails closes the client's connection. One request at a time per client connection
(no pipelining: wrk does not pipeline).

    .venv/bin/python benchmarks/python_floor.py -c gateway.yaml [--workers N] [--style async]

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
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}


class Backend:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.host_header = f"{host}:{port}".encode()
        self.idle: list[Upstream] = []


class _Peer(asyncio.Protocol):
    """One side's connection: a parser fed what arrives, collecting one message's fields and body."""

    def __init__(self, parser: Any) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = parser
        self.fields: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.fail()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _DROPPED:
            self.fields.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def fail(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Upstream(_Peer):
    """One keep-alive connection to a backend; one exchange at a time."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(httptools.HttpResponseParser(self))
        self.backend = backend
        self.client: Client | None = None
        self.waiter: asyncio.Future[bytes] | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.backend.idle:
            self.backend.idle.remove(self)
        self.fail()

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
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if client is not None:
            client.fail()
        super().fail()


class Client(_Peer):
    """One client connection; `use_tasks`: each request's exchange is a task (--style async)."""

    def __init__(self, pick: Callable[[], Backend], use_tasks: bool) -> None:
        super().__init__(httptools.HttpRequestParser(self))
        self.pick = pick
        self.use_tasks = use_tasks
        self.loop = asyncio.get_running_loop()
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        backend = self.pick()
        body = b"".join(self.body)
        method = self.parser.get_method()
        payload = (
            method + b" " + self.url + b" HTTP/1.1\r\nHost: " + backend.host_header + b"\r\n"
            + b"".join(self.fields) + b"Content-Length: %d\r\n\r\n" % len(body) + body
        )  # fmt: skip
        self.url, self.fields, self.body = b"", [], []
        if self.use_tasks:
            self.loop.create_task(self.exchange(backend, payload))
        elif backend.idle:
            backend.idle.pop().send(self, payload)
        else:
            self.loop.create_task(self.connect(backend, payload))

    async def exchange(self, backend: Backend, payload: bytes) -> None:
        """The same exchange as a task awaiting a future (the shape of an async gateway)."""
        try:
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
        except (OSError, asyncio.CancelledError):  # no connection, or the backend failed (fail())
            self.fail()

    async def connect(self, backend: Backend, payload: bytes) -> None:
        try:
            _, upstream = await self.loop.create_connection(
                lambda: Upstream(backend), backend.host, backend.port
            )
        except OSError:
            self.fail()
            return
        upstream.send(self, payload)

    def answer(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


def backends_from(config: str) -> tuple[str, int, list[Backend]]:
    with open(config) as f:
        data = yaml.safe_load(f)
    listen = data.get("listen", {})
    backends = []
    for endpoint in data["models"][0]["endpoints"]:
        parts = urlsplit(endpoint["url"])
        backends.append(Backend(parts.hostname or "127.0.0.1", parts.port or 80))
    return listen.get("host", "127.0.0.1"), int(listen.get("port", 8000)), backends


async def serve(host: str, port: int, backends: list[Backend], use_tasks: bool) -> None:
    turn = 0

    def pick() -> Backend:
        nonlocal turn
        turn += 1
        return backends[turn % len(backends)]

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()  # SIGTERM (how overhead.py stops it) or SIGINT: return, closing the server
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(
        lambda: Client(pick, use_tasks), host, port, reuse_port=True, backlog=1024
    )
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True, help="a modelyard gateway YAML (listen, models[0])")
    parser.add_argument(
        "--workers",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="processes on one port (SO_REUSEPORT)",
    )
    parser.add_argument("--log-level", help="ignored: a `modelyard serve` command line's flags can be reused")
    parser.add_argument(
        "--style",
        choices=("callbacks", "async"),
        default="callbacks",
        help="callbacks only (default), or a task per request awaiting a future, as the gateway does",
    )
    args = parser.parse_args()
    host, port, _ = backends_from(args.config)
    children: list[int] = []
    for _ in range(args.workers - 1):
        pid = os.fork()
        if pid == 0:
            children = []  # a child starts no one and stops no one
            break
        children.append(pid)
    # Each process its own backends and pools (no state shared, like modelyard's workers).
    _, _, backends = backends_from(args.config)
    uvloop.run(serve(host, port, backends, args.style == "async"))
    # The parent: overhead.py stops it alone, so it stops the others (and waits for them).
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
