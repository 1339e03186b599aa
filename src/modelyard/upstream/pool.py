"""One keep-alive aiohttp session per upstream server; aiohttp's exceptions mapped to ours here."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp

from modelyard.config import UpstreamConfig
from modelyard.errors import UpstreamError, UpstreamTimeout, UpstreamUnreachable


class UpstreamPool:
    def __init__(self, config: UpstreamConfig) -> None:
        self._config = config
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._timeout = aiohttp.ClientTimeout(
            total=config.timeout or None, sock_connect=config.connect_timeout
        )

    def _session(self, base_url: str) -> aiohttp.ClientSession:
        session = self._sessions.get(base_url)
        if session is None:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._config.max_connections, ttl_dns_cache=300),
                timeout=self._timeout,
                auto_decompress=False,  # relay bytes as the server encoded them
                skip_auto_headers=("User-Agent", "Content-Type", "Accept-Encoding"),
            )
            self._sessions[base_url] = session
        return session

    async def send(
        self, base_url: str, method: str, path: str, headers: Mapping[str, str], body: bytes | None
    ) -> aiohttp.ClientResponse:
        """Send a request and return once the response head has arrived. The caller must
        `release()` (body read) or `close()` (abandoned) the response."""
        try:
            return await self._session(base_url).request(
                method, base_url + path, headers=headers, data=body, allow_redirects=False
            )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnreachable(f"cannot connect to {base_url}: {exc.os_error or exc}") from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout(f"{base_url} did not answer within {self._config.timeout:g}s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{base_url} failed: {exc!r}") from exc

    async def read(self, response: aiohttp.ClientResponse) -> bytes:
        try:
            return await response.read()
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout(f"{response.url.origin()} did not finish within the deadline") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{response.url.origin()} broke off the response: {exc!r}") from exc
        finally:
            response.release()

    async def probe(self, base_url: str, path: str, deadline: float) -> str:
        """GET a health path; returns "" when healthy (2xx), else why not."""
        try:
            async with self._session(base_url).get(
                base_url + path, timeout=aiohttp.ClientTimeout(total=deadline or None)
            ) as response:
                await response.read()
                return "" if 200 <= response.status < 300 else f"health check answered {response.status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"health check failed: {exc!r}"

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
