"""What the clients of modelyard's JSON APIs share (the scheduler's REST API and feed, a gateway's admin
API): one aiohttp session, made at the first call; a bearer token; https verified with a ClientTls;
each answer the API's JSON object, or an error naming the server."""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any, Self

import aiohttp
import orjson

from modelyard.errors import ModelyardError
from modelyard.security.tls import ClientTls


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def tls_options(url: str, tls: ClientTls | None) -> dict[str, Any]:
    """aiohttp's request options for `url`: an https URL verified with `tls`'s newest context (and
    its server_name), or with the system's CAs."""
    if tls is None or not url.startswith("https:"):
        return {}
    options: dict[str, Any] = {"ssl": tls.context()}
    if tls.server_name:
        options["server_hostname"] = tls.server_name
    return options


def describe_client_error(exc: BaseException, server: str = "the scheduler") -> str:
    """A short cause ("connection refused"), not aiohttp's "Cannot connect to host ... ssl:default";
    `server` names whose certificate did not verify."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        error = exc.certificate_error
        detail = getattr(error, "verify_message", "") or getattr(error, "reason", "") or str(error)
        return f"TLS: {server}'s certificate did not verify ({detail})"
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        return f"TLS handshake failed ({getattr(exc.os_error, 'reason', None) or exc.os_error})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        errno = exc.os_error.errno
        return (os.strerror(errno) if errno else str(exc.os_error) or "cannot connect").lower()
    return str(exc) or type(exc).__name__


class JsonApiClient:
    """`_request` answers (status, the JSON object or None when the body is not one); a subclass says
    what a server that cannot be reached is (`_unreachable`)."""

    server = "the server"  # how errors name it

    def __init__(self, base_url: str, *, timeout: float, token: str | None, tls: ClientTls | None) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._headers = auth_headers(token)
        self._tls = tls

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _unreachable(self, cause: str) -> ModelyardError:
        raise NotImplementedError

    async def _request(
        self, method: str, path: str, body: object = None
    ) -> tuple[int, dict[str, Any] | None]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        url = self.base_url + path
        data = None if body is None else orjson.dumps(body)
        headers = {"Content-Type": "application/json", **self._headers} if data is not None else self._headers
        try:
            async with self._session.request(
                method, url, data=data, headers=headers, **tls_options(url, self._tls)
            ) as response:
                status, raw = response.status, await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise self._unreachable(describe_client_error(exc, self.server)) from None
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = None
        return status, answer if isinstance(answer, dict) else None
