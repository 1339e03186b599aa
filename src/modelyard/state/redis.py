"""Redis-backed state, shared by every gateway pointed at the same server."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisError, ResponseError

from modelyard.errors import StateUnavailable
from modelyard.state.base import Entry


class RedisState:
    def __init__(self, url: str, *, key_prefix: str = "modelyard:", timeout: float = 0.25) -> None:
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            decode_responses=True,
            redis_connect_func=self._on_connect,
        )
        self._prefix = key_prefix
        self._timeout = timeout
        self._run_id: str | None = None

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

    async def close(self) -> None:
        await self._client.aclose()

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
