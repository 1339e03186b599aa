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
from typing import Any
from urllib.parse import quote

from modelyard.errors import (
    BadRequest,
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
from modelyard.upstream.json_api import JsonApiClient
from modelyard.upstream.scheduler_client import check_token_transport

DEFAULT_GATEWAY = "http://127.0.0.1:8000"

_BY_STATUS: dict[int, type[ModelyardError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
}


class AdminClient(JsonApiClient):
    """`async with AdminClient(url, token=...) as gateway: await gateway.keys()`."""

    server = "the gateway"

    def __init__(
        self,
        base_url: str = DEFAULT_GATEWAY,
        *,
        timeout: float = 10.0,
        token: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        if token:
            check_token_transport(base_url.rstrip("/"), "the gateway's listen.tls")
        super().__init__(base_url, timeout=timeout, token=token, tls=tls)

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

    def _unreachable(self, cause: str) -> ModelyardError:
        return UpstreamUnreachable(f"cannot reach the gateway at {self.base_url}: {cause}")

    async def _call(self, method: str, path: str, body: object = None) -> dict[str, Any]:
        status, answer = await self._request(method, path, body)
        if answer is None:
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
