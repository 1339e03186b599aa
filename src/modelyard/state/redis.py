"""Redis-backed state, shared by every gateway pointed at the same server. Keys and channels are
named under `key_prefix`; a subscription holds a connection of its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from modelyard.errors import StateUnavailable
from modelyard.state.base import MAX_BACKOFF, MIN_BACKOFF, Entry

log = logging.getLogger("modelyard.state")

_MIN_READ = 0.01  # a subscription's shortest read


class SubscriptionSilent(RedisError):
    """Nothing came back on a subscription's connection, not even the answer to a PING."""


class RedisState:
    """`ping_interval` and `ping_timeout` watch a subscription: after `ping_interval` seconds in
    which nothing arrived on its connection it sends a PING, and when nothing arrives within
    `ping_timeout` after that, the subscription counts as lost (a proxy or a network that keeps
    the connection open and passes nothing), its connection is closed and it subscribes again."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "modelyard:",
        timeout: float = 0.25,
        ping_interval: float = 15.0,
        ping_timeout: float = 5.0,
    ) -> None:
        if ping_interval <= 0 or ping_timeout <= 0:
            raise ValueError("ping_interval and ping_timeout must be > 0")
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
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
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
        backoff = MIN_BACKOFF
        lost = False  # since the last subscription that worked: one loss, one warning
        while True:
            pubsub = self._subscriber_client().pubsub()
            try:
                await asyncio.wait_for(pubsub.subscribe(name), self._timeout)
                async with contextlib.aclosing(self._arrivals(pubsub)) as arrivals:
                    async for data in arrivals:
                        if lost:
                            log.info("subscribed to %s again", name)
                            lost = False
                        backoff = MIN_BACKOFF
                        if data is not None:
                            yield data
            except (RedisError, OSError, TimeoutError) as exc:
                if not lost:
                    log.warning("subscription to %s lost, subscribing again: %r", name, exc)
                    lost = True
                else:
                    log.debug("subscribing to %s failed, again in %.1fs: %r", name, backoff, exc)
            finally:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await pubsub.aclose()  # closes its connection
            await asyncio.sleep(backoff)  # Redis is away: retry later, not in a tight loop
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _arrivals(self, pubsub: PubSub) -> AsyncGenerator[bytes | None, None]:
        """What arrives on a connection that was just sent SUBSCRIBE: the data of each message,
        None for anything else (the confirmation, a PONG). Raises SubscriptionSilent when an
        answer (to SUBSCRIBE, or to a PING sent after `ping_interval` in which nothing arrived)
        does not arrive within `ping_timeout`.

        redis-py's own health check cannot tell: it sends a PING, but get_message returns None
        whether or not the PONG came back."""
        loop = asyncio.get_running_loop()
        heard = asked = loop.time()  # when anything last arrived; when an answer was asked for
        answered = False
        while True:
            now = loop.time()
            if answered and now - heard >= self._ping_interval:
                await asyncio.wait_for(pubsub.ping(), self._timeout)
                asked, answered = now, False
            deadline = heard + self._ping_interval if answered else asked + self._ping_timeout
            if not answered and now >= deadline:
                raise SubscriptionSilent(f"nothing arrived on the connection in {now - heard:.1f}s")
            message = await pubsub.get_message(timeout=max(_MIN_READ, deadline - now))
            if message is None:
                continue
            heard, answered = loop.time(), True
            data = message.get("data")
            yield data if message.get("type") == "message" and isinstance(data, bytes) else None

    async def close(self) -> None:
        await self._client.aclose()
        if self._subscriber is not None:
            await self._subscriber.aclose()

    def _subscriber_client(self) -> aioredis.Redis:
        """A client of bytes for subscriptions; its connections fail fast and are not retried
        inside redis-py, `subscribe` retries with its own backoff and watches them with its own
        PINGs (`_arrivals`)."""
        if self._subscriber is None:
            self._subscriber = aioredis.Redis.from_url(
                self._url,
                socket_timeout=self._timeout,
                socket_connect_timeout=self._timeout,
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
