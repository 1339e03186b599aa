"""`RepositoryClient`: the OIP v2 model-repository API as MLServer and Triton serve it.

    POST /v2/repository/index                  [{"name", "version", "state", "reason"}, ...]
    POST /v2/repository/models/{name}/load     200 once loaded (both servers load synchronously)
    POST /v2/repository/models/{name}/unload   200 once unloaded
    GET  /v2/health/live, /v2/health/ready, /v2/models/{name}/ready

An error answer raises `ModelServerRefused` carrying the server's status and error text
(MLServer and Triton answer `{"error": "..."}`); a server that cannot be reached raises the
upstream errors of `http1` (`UpstreamUnreachable`, `UpstreamTimeout`, `UpstreamClosed`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

import orjson

from modelyard.errors import ModelServerRefused, UpstreamError, UpstreamTimeout
from modelyard.upstream.http1 import Http1Client

_JSON = (("Content-Type", "application/json"), ("Accept", "application/json"))
_MAX_ERROR_TEXT = 2000


@dataclass(frozen=True)
class RepositoryModel:
    """One entry of the repository index. `state` is the server's word: READY, UNAVAILABLE,
    LOADING, UNLOADING (MLServer and Triton agree on READY)."""

    name: str
    version: str
    state: str
    reason: str

    @property
    def ready(self) -> bool:
        return self.state.upper() == "READY"


def error_text(body: bytes) -> str:
    """The server's error message: `{"error": "..."}`'s text, else the body (bounded)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        for key in ("error", "detail", "message"):
            value = parsed.get(key)
            if isinstance(value, str) and value:
                return value[:_MAX_ERROR_TEXT]
    return body.decode("utf-8", "replace").strip()[:_MAX_ERROR_TEXT] or "(empty body)"


class RepositoryClient:
    """Calls one inference server at `base_url` (http://host:port). `timeout` bounds each call:
    a load may take a while (a large model, MLServer starting a worker), so it is generous."""

    def __init__(self, base_url: str, *, timeout: float = 300.0, client: Http1Client | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._own_client = client is None
        self._client = client or Http1Client(max_connections=8, connect_timeout=5.0)

    async def _call(
        self,
        method: str,
        path: str,
        body: bytes | None,
        deadline: float | None = None,
        extra: Sequence[tuple[str, str]] = (),
    ) -> tuple[int, bytes]:
        headers: Sequence[tuple[str, str]] = _JSON if body is not None else ()
        if extra:
            headers = (*headers, *extra)
        response = await self._client.request(
            self.base_url, method, path, headers, body, deadline or self.timeout
        )
        return response.status, await response.read()

    async def _checked(
        self, what: str, path: str, body: bytes | None, extra: Sequence[tuple[str, str]] = ()
    ) -> bytes:
        status, answer = await self._call("POST", path, body, extra=extra)
        if not 200 <= status < 300:
            text = error_text(answer)
            raise ModelServerRefused(
                f"{what}: {self.base_url} answered {status}: {text}", server_status=status, server_text=text
            )
        return answer

    async def index(self, *, ready_only: bool = False) -> list[RepositoryModel]:
        answer = await self._checked(
            "repository index", "/v2/repository/index", orjson.dumps({"ready": ready_only})
        )
        entries = orjson.loads(answer) if answer else []
        if not isinstance(entries, list):
            raise ModelServerRefused(
                f"repository index: {self.base_url} answered a non-list", server_status=200, server_text=""
            )
        return [
            RepositoryModel(
                name=str(e.get("name", "")),
                version=str(e.get("version") or ""),
                state=str(e.get("state") or ""),
                reason=str(e.get("reason") or ""),
            )
            for e in entries
            if isinstance(e, dict) and e.get("name")
        ]

    async def load(self, name: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        """`headers`: sent along (an agent's trace context)."""
        path = f"/v2/repository/models/{quote(name, safe='')}/load"
        await self._checked(f"load {name}", path, b"{}", headers)

    async def unload(self, name: str, headers: Sequence[tuple[str, str]] = ()) -> bool:
        """Unload `name`; False when the server did not know it (404: already gone), as Seldon
        treats it. Triton answers 400 for an unknown model on some paths: that stays an error."""
        try:
            await self._checked(
                f"unload {name}", f"/v2/repository/models/{quote(name, safe='')}/unload", b"{}", headers
            )
        except ModelServerRefused as error:
            if error.server_status == 404:
                return False
            raise
        return True

    async def _ok(self, path: str, deadline: float) -> bool:
        try:
            status, _ = await self._call("GET", path, None, deadline)
        except UpstreamError:
            return False
        return 200 <= status < 300

    async def live(self, deadline: float = 2.0) -> bool:
        return await self._ok("/v2/health/live", deadline)

    async def ready(self, deadline: float = 2.0) -> bool:
        return await self._ok("/v2/health/ready", deadline)

    async def model_ready(self, name: str, deadline: float = 2.0) -> bool:
        return await self._ok(f"/v2/models/{quote(name, safe='')}/ready", deadline)

    async def wait_live(self, within: float, interval: float = 0.2) -> None:
        """Poll `/v2/health/live` until it answers 2xx; `UpstreamTimeout` after `within` seconds."""
        loop = asyncio.get_running_loop()
        until = loop.time() + within
        while True:
            if await self.live(deadline=max(0.1, min(2.0, until - loop.time()))):
                return
            if loop.time() + interval > until:
                raise UpstreamTimeout(f"{self.base_url} was not live within {within:g}s")
            await asyncio.sleep(interval)  # a bounded poll for a server process that is starting

    async def close(self) -> None:
        if self._own_client:
            self._client.close()
