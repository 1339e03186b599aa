"""Redis-backed state, shared by every gateway pointed at the same server."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from modelyard.errors import StateUnavailable


class RedisState:
    def __init__(self, url: str, *, key_prefix: str = "modelyard:", timeout: float = 0.25) -> None:
        self._client = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
        )
        self._prefix = key_prefix
        self._timeout = timeout

    async def get(self, key: str) -> str | None:
        try:
            value = await asyncio.wait_for(self._client.get(self._prefix + key), self._timeout)
            return value if value is None else str(value)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis get failed: {exc!r}") from exc

    async def set(self, key: str, value: str, ttl: float) -> None:
        try:
            await asyncio.wait_for(
                self._client.set(self._prefix + key, value, px=max(1, int(ttl * 1000))), self._timeout
            )
        except (RedisError, OSError, TimeoutError) as exc:
            raise StateUnavailable(f"redis set failed: {exc!r}") from exc

    async def close(self) -> None:
        await self._client.aclose()
