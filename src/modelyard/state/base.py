"""The state protocols: what the gateway needs from a store of routing state, and what
`FallbackState` needs from the shared store it falls back from."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple, Protocol

# Seconds before the remote store is tried again after a failure (a subscription: subscribing again
# after its connection was lost), doubling up to MAX_BACKOFF.
MIN_BACKOFF = 0.5
MAX_BACKOFF = 30.0


class Entry(NamedTuple):
    """One key with its value and the seconds it has left to live."""

    key: str
    value: str
    ttl: float


class SharedState(Protocol):
    """A small TTL key/value store. Values are short strings (endpoint names). Besides, channels:
    messages to every gateway on the same store, at most once, lost when nobody listens (Redis
    pub/sub); a store of one gateway's own delivers them in its process only."""

    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl: float) -> None: ...

    async def publish(self, channel: str, payload: bytes) -> bool:
        """Send `payload` to the subscribers of `channel`; True when the store took it, False when
        it was dropped because the store is away (a store that reports failures raises
        StateUnavailable instead)."""
        ...

    def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        """What is published on `channel` from when the iteration starts until it is closed or
        cancelled. Never raises for a store that goes away: it reconnects in the background, and
        what was published meanwhile is lost."""
        ...

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
