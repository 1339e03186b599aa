"""Redis-backed state, shared by every gateway pointed at the same server. Keys and channels are
named under `key_prefix`; a subscription holds a connection of its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from modelyard.errors import StateUnavailable
from modelyard.state.base import Entry

log = logging.getLogger("modelyard.state")

_MIN_BACKOFF = 0.5  # before subscribing again after the connection was lost, doubling
_MAX_BACKOFF = 30.0
_POLL = 1.0  # a subscription's longest read, so that its health check (a PING) runs
_HEALTH_CHECK = 15  # seconds between PINGs on an idle subscription, to notice a silent loss


class RedisState:
    def __init__(self, url: str, *, key_prefix: str = "modelyard:", timeout: float = 0.25) -> None:
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            decode_responses=True,
            redis_connect_func=self._on_connect,
        )
        self._url = url
        self._prefix = key_prefix
        self._timeout = timeout
        self._run_id: str | None = None
        self._subscriber: aioredis.Redis | None = None

    @property
    def epoch(self) -> str | None:
        """The server's run_id, read on every new connection: a restarted (emptied) Redis has a
        new one, whether or not a command failed in between."""
        return self._run_id

    async def get(self, key: str) -> str | None:
        try:
            value = await asyncio.wait_for(self._client.get(self._prefix + key), self._timeout)
            return value if value is None else str(value)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis get failed: {exc!r}") from exc

    async def set(self, key: str, value: str, ttl: float) -> None:
        try:
            await asyncio.wait_for(
                self._client.set(self._prefix + key, value, px=_milliseconds(ttl)), self._timeout
            )
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis set failed: {exc!r}") from exc

    async def set_many_if_absent(self, entries: Sequence[Entry]) -> int:
        if not entries:
            return 0
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, value, ttl in entries:
                    pipe.set(self._prefix + key, value, px=_milliseconds(ttl), nx=True)
                replies = await asyncio.wait_for(pipe.execute(), self._timeout)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis pipelined set nx failed: {exc!r}") from exc
        return sum(1 for reply in replies if reply)

    async def publish(self, channel: str, payload: bytes) -> bool:
        try:
            await asyncio.wait_for(self._client.publish(self._prefix + channel, payload), self._timeout)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis publish failed: {exc!r}") from exc
        return True

    async def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        name = self._prefix + channel
        backoff = _MIN_BACKOFF
        while True:
            pubsub = self._subscriber_client().pubsub(ignore_subscribe_messages=True)
            try:
                await asyncio.wait_for(pubsub.subscribe(name), self._timeout)
                if backoff > _MIN_BACKOFF:
                    log.info("subscribed to %s again", name)
                backoff = _MIN_BACKOFF
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=_POLL)
                    if message is not None and isinstance(data := message.get("data"), bytes):
                        yield data
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("subscription to %s lost, subscribing again in %.1fs: %r", name, backoff, exc)
            finally:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # gives its connection back
            await asyncio.sleep(backoff)  # Redis is away: retry later, not in a tight loop
            backoff = min(backoff * 2, _MAX_BACKOFF)

    async def close(self) -> None:
        await self._client.aclose()
        if self._subscriber is not None:
            await self._subscriber.aclose()

    def _subscriber_client(self) -> aioredis.Redis:
        """A client of bytes for subscriptions; its connections fail fast and are not retried
        inside redis-py, `subscribe` retries with its own backoff."""
        if self._subscriber is None:
            self._subscriber = aioredis.Redis.from_url(
                self._url,
                socket_timeout=self._timeout,
                socket_connect_timeout=self._timeout,
                health_check_interval=_HEALTH_CHECK,
                retry=Retry(NoBackoff(), 0),
            )
        return self._subscriber

    async def _on_connect(self, connection: AbstractConnection) -> None:
        await connection.on_connect()  # the handshake redis-py runs when given no callback
        try:
            await connection.send_command("INFO", "server")
            info = await connection.read_response()
        except ResponseError:
            return  # INFO renamed or denied: restarts are then noticed only through failures
        text = info.decode() if isinstance(info, bytes) else str(info)
        for line in text.splitlines():
            if line.startswith("run_id:"):
                self._run_id = line.removeprefix("run_id:").strip()


def _milliseconds(ttl: float) -> int:
    return max(1, int(ttl * 1000))
