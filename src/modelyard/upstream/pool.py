"""Upstream calls for the gateway: forwarding and health probes over keep-alive pools."""

from __future__ import annotations

from collections.abc import Coroutine, Iterable
from typing import Any

from modelyard.config import UpstreamConfig
from modelyard.errors import ModelyardError
from modelyard.protocols.http import RawHeaders
from modelyard.upstream.headers import NOT_RELAYED
from modelyard.upstream.http1 import Flight, Http1Client, UpstreamResponse


class UpstreamPool:
    """`relay_drop`: the answer fields the caller does not pass on (`UpstreamResponse.relayed`)."""

    def __init__(self, config: UpstreamConfig, relay_drop: frozenset[bytes] = NOT_RELAYED) -> None:
        self._config = config
        self.relay_drop = relay_drop
        self._client = Http1Client(
            max_connections=config.max_connections,
            connect_timeout=config.connect_timeout,
            relay_drop=relay_drop,
        )

    @property
    def client(self) -> Http1Client:
        return self._client

    def send(
        self,
        base_url: str,
        method: str,
        path: str,
        headers: RawHeaders | Iterable[tuple[str, str]],
        body: bytes | None,
        deadline: float | None = None,
        flight: Flight | None = None,
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """Send a request; the coroutine returns once the response head has arrived. `deadline`
        (seconds, for the whole exchange, body included) is capped by `upstream.timeout`; `flight`
        lets the caller abort it until then. The caller must `read()` the response or `close()` it.
        (Not a coroutine itself: one frame fewer on every request.)"""
        return self._client.request(base_url, method, path, headers, body, self.time_limit(deadline), flight)

    def time_limit(self, deadline: float | None) -> float | None:
        """Seconds an upstream exchange may take: `deadline` capped by `upstream.timeout`."""
        limit = self._config.timeout or None
        if deadline is not None:
            limit = min(limit, deadline) if limit else deadline
        return limit

    async def probe(self, base_url: str, path: str, deadline: float) -> str:
        """GET a health path; returns "" when healthy (2xx), else why not."""
        try:
            response = await self._client.request(base_url, "GET", path, (), None, deadline or None)
            await response.read()
        except ModelyardError as exc:
            return f"health check failed: {exc.message}"
        if 200 <= response.status < 300:
            return ""
        return f"health check answered {response.status}"

    async def close(self) -> None:
        self._client.close()
