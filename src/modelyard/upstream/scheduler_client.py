"""The scheduler's REST API (docs/placement.md) for the CLI and anything else that manages models.

Answers come back as the API's JSON, unchanged. An error envelope becomes the modelyard error of
its status and code (400 invalid_model_spec, 404 model_not_found, 409 model_being_deleted, ...)
with the scheduler's message; a scheduler that cannot be reached, or answers with something that is
not the API's JSON, is SchedulerUnavailable naming its address.

`token` is sent as `Authorization: Bearer <token>` (never logged nor put in an error); an https
scheduler is verified with `tls` (ClientTls: its CA file, a client certificate), or the system's CAs.
401 is Unauthorized, 403 Forbidden, with the scheduler's message. A token is not sent over plain
http to a host other than loopback, where anyone on the way could read it and then act with it
(`plain_token_refusal`): the client refuses at construction (ConfigError), unless told
`allow_plain_token` (a network its owner accepts as plain text).
"""

from __future__ import annotations

import builtins
import os
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
    ModelBeingDeleted,
    ModelNotFound,
    ModelSpecInvalid,
    ModelyardError,
    NotFound,
    PayloadTooLarge,
    SchedulerUnavailable,
    Unauthorized,
)
from modelyard.security.tls import ClientTls

DEFAULT_SCHEDULER = "http://127.0.0.1:9004"

# code first (the precise class), then status (its family)
_BY_CODE: dict[str, type[ModelyardError]] = {
    "invalid_model_spec": ModelSpecInvalid,
    "model_not_found": ModelNotFound,
    "model_being_deleted": ModelBeingDeleted,
}
_BY_STATUS: dict[int, type[ModelyardError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
}


class SchedulerClient:
    """`async with SchedulerClient(url) as scheduler: await scheduler.list()`."""

    def __init__(
        self,
        base_url: str = DEFAULT_SCHEDULER,
        *,
        timeout: float = 10.0,
        token: str | None = None,
        tls: ClientTls | None = None,
        allow_plain_token: bool = False,
    ) -> None:
        if token and not allow_plain_token:
            check_token_transport(base_url)
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._headers = auth_headers(token)
        self._tls = tls

    async def apply(self, spec: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
        """PUT a model spec (plain or a Seldon `Model`); the model with its `change`."""
        name = name or _spec_name(spec)
        return await self._call("PUT", f"/v1/models/{quote(name, safe='')}", spec)

    async def get(self, name: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/models/{quote(name, safe='')}")

    async def list(self) -> list[dict[str, Any]]:
        return _items(await self._call("GET", "/v1/models"), "models")

    async def delete(self, name: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/v1/models/{quote(name, safe='')}")

    async def servers(self) -> builtins.list[dict[str, Any]]:
        return _items(await self._call("GET", "/v1/servers"), "servers")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> SchedulerClient:
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
            raise SchedulerUnavailable(
                f"cannot reach the scheduler at {self.base_url}: {describe_client_error(exc)}"
            ) from None
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise SchedulerUnavailable(
                f"the scheduler at {self.base_url} answered {method} {path} with {status} "
                "and a body that is not the API's JSON"
            )
        if status >= 400:
            raise error_from_envelope(status, answer, self.base_url)
        return answer


def error_from_envelope(status: int, answer: Mapping[str, Any], where: str) -> ModelyardError:
    """The modelyard error an `{"error": {"message", "type", "code"}}` answer stands for."""
    envelope = answer.get("error")
    details = envelope if isinstance(envelope, dict) else {}
    message = str(details.get("message") or envelope or f"the scheduler answered {status}")
    cls = _BY_CODE.get(str(details.get("code")))
    if cls is None or cls.status != status:
        cls = _BY_STATUS.get(status)
    if cls is None:
        return SchedulerUnavailable(f"the scheduler at {where} answered {status}: {message}")
    # The scheduler wrote the message; keep it as it is rather than rebuild it from parts.
    error = cls.__new__(cls)
    ModelyardError.__init__(error, message)
    if isinstance(error, ModelSpecInvalid):
        error.source, error.problems = where, [message]
    return error


def plain_token_refusal(url: str) -> str | None:
    """Why a bearer token must not be sent to `url` (plain http to a host other than loopback), or
    None when it may (https, or this machine)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or on_loopback(parts.hostname or ""):
        return None
    return (
        f"a token over plain http to {parts.hostname}, a host other than loopback, could be read on the "
        "way: use https (the scheduler's --tls-cert), or reach it on 127.0.0.1 (kubectl port-forward)"
    )


def check_token_transport(url: str) -> None:
    """ConfigError (naming the URL, never the token) when a token must not be sent to `url`."""
    problem = plain_token_refusal(url)
    if problem is not None:
        raise ConfigError(url.rstrip("/"), [problem])


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


def _spec_name(spec: Mapping[str, Any]) -> str:
    metadata = spec.get("metadata")
    name = spec.get("name") or (metadata.get("name") if isinstance(metadata, Mapping) else None)
    if not isinstance(name, str) or not name:
        raise BadRequest("the model spec has no name (name, or metadata.name for a Seldon Model)")
    return name


def _items(answer: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    items = answer.get(key)
    if not isinstance(items, list):
        raise SchedulerUnavailable(f"the scheduler's answer has no {key!r} list")
    return items
