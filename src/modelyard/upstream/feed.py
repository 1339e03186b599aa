"""The scheduler's feed (`GET /v1/feed`) as a stream of parsed events, over one connection.

aiohttp's client, not the proxy's Http1Client: this is one long-lived request, far from the hot
path. Lines are split here rather than with `readline()`, whose line limit (64 KiB) a snapshot of
a few hundred models passes. A peer that sends nothing, not even a ping, for `ping_timeout` is
taken for dead: a half-open TCP connection would otherwise keep the gateway on stale endpoints
forever.

With `token_file`, each connection sends `Authorization: Bearer <token>` read from it then (a
rotated Secret is picked up on the next connection); an https scheduler is verified with `tls`.
A refusal (401, 403) is SchedulerUnavailable with the scheduler's message, never the token. A token
for a plain http scheduler on a host other than loopback is refused at construction (ConfigError:
anyone on the way could read it), unless `allow_plain_token`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
import orjson

from modelyard.errors import SchedulerUnavailable
from modelyard.protocols.feed import FeedEvent, FeedLineInvalid, parse_feed_line
from modelyard.security.tls import ClientTls
from modelyard.security.tokens import TokenFileError, read_token
from modelyard.upstream.json_api import auth_headers, describe_client_error, tls_options
from modelyard.upstream.scheduler_client import (
    check_token_transport,
)

log = logging.getLogger("modelyard.upstream.feed")

FEED_PATH = "/v1/feed"
MAX_LINE_BYTES = 64 * 1024 * 1024  # a snapshot line; past this the feed is not one we can follow


class FeedClient:
    """`async for event in client.events(): ...` reads one connection's events until it breaks,
    then raises SchedulerUnavailable (the caller reconnects). Lines that cannot be used are logged
    and skipped."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        ping_timeout: float,
        token_file: str = "",
        tls: ClientTls | None = None,
        allow_plain_token: bool = False,
    ) -> None:
        if token_file and not allow_plain_token:
            check_token_transport(base_url)  # before the file: no token read for nothing
        self.url = base_url.rstrip("/") + FEED_PATH
        self._connect_timeout = connect_timeout
        self._ping_timeout = ping_timeout
        self._token_file = token_file
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None
        if token_file:
            read_token(token_file)  # a file that cannot be used stops the start: TokenFileError

    def _headers(self) -> dict[str, str]:
        if not self._token_file:
            return {}
        try:
            token = read_token(self._token_file)
        except TokenFileError as exc:
            raise SchedulerUnavailable(f"cannot send the scheduler's token: {exc.message}") from None
        return auth_headers(token)

    async def events(self) -> AsyncIterator[FeedEvent]:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout)
            self._session = aiohttp.ClientSession(timeout=timeout)
        headers = {"Accept": "application/x-ndjson", **self._headers()}
        try:
            async with asyncio.timeout(self._connect_timeout + self._ping_timeout):
                response = await self._session.get(
                    self.url, headers=headers, **tls_options(self.url, self._tls)
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise SchedulerUnavailable(
                f"cannot reach the scheduler at {self.url}: {describe_client_error(exc)}"
            ) from None
        async with response:
            if response.status != 200:
                said = await _error_message(response)
                raise SchedulerUnavailable(f"the scheduler at {self.url} answered {response.status}{said}")
            async for line in self._lines(response):
                try:
                    event = parse_feed_line(line)
                except FeedLineInvalid as exc:
                    log.warning("scheduler feed: skipping a line: %s", exc)
                    continue
                if event is not None:
                    yield event
        raise SchedulerUnavailable(f"the scheduler at {self.url} ended the feed")

    async def _lines(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        buffered = bytearray()  # appended to in place: a long snapshot line costs no quadratic copying
        while True:
            try:
                async with asyncio.timeout(self._ping_timeout):
                    chunk = await response.content.readany()
            except TimeoutError:
                raise SchedulerUnavailable(
                    f"the scheduler at {self.url} sent nothing for {self._ping_timeout:g}s"
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise SchedulerUnavailable(
                    f"the feed from {self.url} broke: {describe_client_error(exc)}"
                ) from None
            if not chunk:
                return
            start = len(buffered)
            buffered += chunk
            if b"\n" not in chunk:
                if len(buffered) > MAX_LINE_BYTES:
                    raise SchedulerUnavailable(f"a feed line from {self.url} is over {MAX_LINE_BYTES} bytes")
                continue
            end = buffered.rindex(b"\n", start)
            for line in bytes(buffered[:end]).split(b"\n"):
                yield line
            del buffered[: end + 1]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _error_message(response: aiohttp.ClientResponse) -> str:
    """`: <the scheduler's message>` from an error envelope (at most 4 KiB read), or ""."""
    try:
        async with asyncio.timeout(2.0):
            body = await response.content.read(4096)
        error = orjson.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else None
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError, AttributeError):
        return ""
    return f": {message}" if isinstance(message, str) and message else ""
