"""The state protocols: what the gateway needs from a store of routing state, and what
`FallbackState` needs from the shared store it falls back from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol


class Entry(NamedTuple):
    """One key with its value and the seconds it has left to live."""

    key: str
    value: str
    ttl: float


class SharedState(Protocol):
    """A small TTL key/value store. Values are short strings (endpoint names)."""

    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl: float) -> None: ...

    async def close(self) -> None: ...


class RemoteState(SharedState, Protocol):
    """A store several gateways share. Besides SharedState, what writing back needs: what a gateway
    learnt on its own goes back with `set_many_if_absent`, and `epoch` tells when the store lost
    what it held."""

    @property
    def epoch(self) -> str | None:
        """Changes whenever the store may have lost its contents (a Redis restart: its run_id);
        None until known. Read without I/O, so callers may check it after every operation."""
        ...

    async def set_many_if_absent(self, entries: Sequence[Entry]) -> int:
        """Set each entry whose key holds no value (Redis SET NX PX), in one round trip where the
        store allows; return how many were set. An existing value always wins."""
        ...
