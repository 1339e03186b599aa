"""A gateway's admin API for API keys and usage (`modelyard key`): GET, POST and DELETE /admin/keys,
GET /admin/usage.

Answers come back as the API's JSON, unchanged. An error envelope becomes the modelyard error of its
status (400 BadRequest, 401 Unauthorized, 404 NotFound, 409 Conflict, ...) carrying the gateway's
message as it wrote it; a gateway that cannot be reached is UpstreamUnreachable, one that answers
with something other than the API's JSON UpstreamError, each naming its address.

`token` (the gateway's `admin.token`) is sent as `Authorization: Bearer <token>`, never logged nor
put in an error. An https gateway is verified with `tls` (ClientTls: its CA file), or the system's
CAs. As the scheduler's client does, it refuses at construction (ConfigError) to send a token over
plain http to a host other than loopback, where anyone on the way could read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import orjson

from modelyard.config import on_loopback
from modelyard.errors import (
    BadRequest,
    ConfigError,
    Conflict,
    Forbidden,
    ModelyardError,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    UpstreamError,
    UpstreamUnreachable,
)
from modelyard.security.tls import ClientTls
from modelyard.upstream.scheduler_client import auth_headers, describe_client_error, tls_options

DEFAULT_GATEWAY = "http://127.0.0.1:8000"

_BY_STATUS: dict[int, type[ModelyardError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
}


class AdminClient:
    """`async with AdminClient(url, token=...) as gateway: await gateway.keys()`."""

    def __init__(
        self,
        base_url: str = DEFAULT_GATEWAY,
        *,
        timeout: float = 10.0,
        token: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if token:
            _check_token_transport(self.base_url)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._headers = auth_headers(token)
        self._tls = tls

    async def keys(self) -> dict[str, Any]:
        """{"keys": [...]} (and "tenants"): every key, never a key itself."""
        return await self._call("GET", "/admin/keys")

    async def create_key(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The key made, as listed, with the key itself (`key`), which the gateway shows this once."""
        return await self._call("POST", "/admin/keys", body)

    async def revoke_key(self, name: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/admin/keys/{quote(name, safe='')}")

    async def usage(self, day: str | None = None) -> dict[str, Any]:
        """A UTC day's usage by tenant and key (today's when `day` is None)."""
        query = f"?day={quote(day, safe='')}" if day else ""
        return await self._call("GET", "/admin/usage" + query)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _call(self, method: str, path: str, body: object = None) -> dict[str, Any]:
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
            cause = describe_client_error(exc, "the gateway")
            raise UpstreamUnreachable(f"cannot reach the gateway at {self.base_url}: {cause}") from None
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise UpstreamError(
                f"the gateway at {self.base_url} answered {method} {path} with {status} and a body that "
                "is not the admin API's JSON (is it a modelyard gateway?)"
            )
        if status >= 400:
            raise _error(status, answer, self.base_url)
        return answer


def _error(status: int, answer: Mapping[str, Any], where: str) -> ModelyardError:
    """The modelyard error an `{"error": {"message", "type", "code"}}` answer stands for, with the
    gateway's message as it wrote it."""
    envelope = answer.get("error")
    details = envelope if isinstance(envelope, dict) else {}
    message = str(details.get("message") or envelope or f"the gateway answered {status}")
    cls = _BY_STATUS.get(status)
    if cls is None:
        return UpstreamError(f"the gateway at {where} answered {status}: {message}")
    error = cls.__new__(cls)
    ModelyardError.__init__(error, message)
    return error


def _check_token_transport(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme == "http" and not on_loopback(parts.hostname or ""):
        raise ConfigError(
            url,
            [
                f"the admin token over plain http to {parts.hostname}, a host other than loopback, could "
                "be read on the way: use https (the gateway's listen.tls), or reach it on 127.0.0.1 "
                "(kubectl port-forward)"
            ],
        )
