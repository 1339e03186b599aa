"""RedisState's subscription through a TCP proxy to a real redis-server: a connection that stays
open but passes nothing (a proxy or a network gone silent) is noticed by its PINGs going unanswered,
closed, and subscribed again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from modelyard.state import RedisState
from support import wait_until


class _Link:
    """One client connection through the proxy; a dead one forwards nothing, for good."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead


class SilentProxy:
    """Forwards TCP connections to `target_port` on loopback until `black_hole()`: from then on
    the connections open, and those accepted until `forward()`, stay open and pass nothing either
    way (what arrives is read and discarded)."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._server: asyncio.Server | None = None
        self._links: list[_Link] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._black_holing = False
        self.accepted = 0  # client connections
        self.closed_by_client = 0  # client connections the client closed
        self.pongs = 0  # answers to PING forwarded to clients

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    def black_hole(self) -> None:
        self._black_holing = True
        for link in self._links:
            link.dead = True

    def forward(self) -> None:
        """New connections are forwarded again; the ones black-holed stay dead."""
        self._black_holing = False

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        link = _Link(self._black_holing)
        self._links.append(link)
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        self._writers += [client_writer, upstream_writer]

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, from_client: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    if link.dead:
                        continue
                    if not from_client:
                        self.pongs += data.lower().count(b"pong")  # +PONG, or RESP3's
                    sink.write(data)
                    await sink.drain()
                if from_client:
                    self.closed_by_client += 1
            sink.close()

        await asyncio.gather(
            pump(client_reader, upstream_writer, True),
            pump(upstream_reader, client_writer, False),
            return_exceptions=True,
        )


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[SilentProxy]:
    port = urlsplit(redis_url).port
    assert port is not None
    proxy = SilentProxy(port)
    await proxy.start()
    yield proxy
    await proxy.close()


async def test_a_subscription_that_hears_nothing_is_noticed_closed_and_made_again(proxy, redis_url, caplog):
    caplog.set_level(logging.INFO, "modelyard.state")
    prefix = f"test-{uuid.uuid4().hex}:"
    state = RedisState(proxy.url, key_prefix=prefix, ping_interval=0.1, ping_timeout=0.5)
    publisher = aioredis.Redis.from_url(redis_url)  # straight to Redis, not through the proxy
    received: list[bytes] = []

    async def listen() -> None:
        async for payload in state.subscribe("c"):
            received.append(payload)

    def heard(payload: bytes) -> Callable[[], Awaitable[bool]]:
        async def predicate() -> bool:  # publish until it arrives: a channel keeps nothing
            await publisher.publish(prefix + "c", payload)
            return payload in received

        return predicate

    listener = asyncio.create_task(listen())
    try:
        await wait_until(heard(b"before"))

        async def pings_answered() -> bool:  # an idle subscription that answers is kept
            return proxy.pongs >= 3

        await wait_until(pings_answered)
        assert (proxy.accepted, proxy.closed_by_client) == (1, 0)

        proxy.black_hole()

        async def connection_given_up() -> bool:
            return proxy.closed_by_client == 1

        await wait_until(connection_given_up)
        proxy.forward()
        await wait_until(heard(b"after"))  # on a new connection: the black-holed one stays dead
        assert proxy.accepted >= 2
        messages = [r.getMessage() for r in caplog.records]
        assert sum("subscription to" in m and "lost" in m for m in messages) == 1
        assert sum("subscribed to" in m and "again" in m for m in messages) == 1
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await publisher.aclose()
        await state.close()
