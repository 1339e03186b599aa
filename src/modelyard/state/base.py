"""The SharedState protocol: what the gateway needs from a store of routing state."""

from __future__ import annotations

from typing import Protocol


class SharedState(Protocol):
    """A small TTL key/value store. Values are short strings (endpoint names)."""

    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl: float) -> None: ...

    async def close(self) -> None: ...
