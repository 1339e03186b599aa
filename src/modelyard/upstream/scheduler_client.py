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
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

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
from modelyard.upstream.json_api import JsonApiClient

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


class SchedulerClient(JsonApiClient):
    """`async with SchedulerClient(url) as scheduler: await scheduler.list()`."""

    server = "the scheduler"

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
        super().__init__(base_url, timeout=timeout, token=token, tls=tls)

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

    def _unreachable(self, cause: str) -> ModelyardError:
        return SchedulerUnavailable(f"cannot reach the scheduler at {self.base_url}: {cause}")

    async def _call(self, method: str, path: str, body: object = None) -> dict[str, Any]:
        status, answer = await self._request(method, path, body)
        if answer is None:
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


def plain_token_refusal(url: str, https_how: str = "the scheduler's --tls-cert") -> str | None:
    """Why a bearer token must not be sent to `url` (plain http to a host other than loopback), or
    None when it may (https, or this machine). `https_how`: how the server is given https."""
    parts = urlsplit(url)
    if parts.scheme != "http" or on_loopback(parts.hostname or ""):
        return None
    return (
        f"a token over plain http to {parts.hostname}, a host other than loopback, could be read on the "
        f"way: use https ({https_how}), or reach it on 127.0.0.1 (kubectl port-forward)"
    )


def check_token_transport(url: str, https_how: str = "the scheduler's --tls-cert") -> None:
    """ConfigError (naming the URL, never the token) when a token must not be sent to `url`."""
    problem = plain_token_refusal(url, https_how)
    if problem is not None:
        raise ConfigError(url.rstrip("/"), [problem])


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
