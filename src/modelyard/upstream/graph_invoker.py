"""Graph steps over HTTP: POST the step's bytes to its service URL, as KServe's router does.

Only status and body come back (KServe discards upstream headers); a call with no answer becomes
a graph failure whose cause reads like the Go client's error, so that answers match KServe's.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Mapping, Sequence
from urllib.parse import quote, urljoin, urlsplit

from modelyard.errors import ModelyardError, UpstreamTimeout
from modelyard.graph import GraphFailure, InferenceStep, Outcome
from modelyard.upstream.http1 import Http1Client

_PATH_SAFE = "/%:@!$&'()*+,;=-._~"
_QUERY_SAFE = _PATH_SAFE + "?"
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 10  # Go's default CheckRedirect


class UrlInvoker:
    """Calls `serviceUrl` steps, and `serviceName` steps through `services` (name -> URL), the
    resolution KServe's controller makes before it deploys the router."""

    def __init__(
        self,
        client: Http1Client,
        *,
        services: Mapping[str, str] | None = None,
        call_timeout: float | None = None,
        mesh_probe_url: str | None = None,
    ) -> None:
        self._client = client
        self._services = dict(services or {})
        self._call_timeout = call_timeout
        self._mesh_probe_url = mesh_probe_url
        self._in_mesh: bool | None = None  # probed once, on the first https call

    async def in_mesh(self) -> bool:
        """KServe's router: with an Istio sidecar (its admin port answers 200), https services are
        called over plain http and the sidecar handles TLS. Refused: not in a mesh. Asked once."""
        if self._in_mesh is None:
            if not self._mesh_probe_url:
                self._in_mesh = False
            else:
                parts = urlsplit(self._mesh_probe_url)
                try:
                    response = await self._client.request(
                        f"{parts.scheme}://{parts.netloc}", "GET", parts.path or "/", (), None, 3.0
                    )
                    await response.read()
                    self._in_mesh = response.status == 200
                except ModelyardError as exc:
                    cause = exc.__cause__
                    if not (isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED):
                        raise GraphFailure(500, f'Get "{self._mesh_probe_url}": {exc.message}') from None
                    self._in_mesh = False
        return self._in_mesh

    def url_for(self, step: InferenceStep) -> str:
        if step.service_url:
            return step.service_url
        return self._services.get(step.service_name, "")

    async def call(self, step: InferenceStep, body: bytes, headers: Sequence[tuple[str, str]]) -> Outcome:
        return await self.post(self.url_for(step), body, headers)

    async def post(self, url: str, body: bytes, headers: Sequence[tuple[str, str]]) -> Outcome:
        """POST as Go's default client does: up to 10 redirects followed (301/302/303 turn into a
        GET without a body, 307/308 repeat the POST), one `serviceClient` deadline for all."""
        sent = list(headers)
        if not any(name.lower() == "content-type" for name, _ in sent):
            sent.append(("Content-Type", "application/json"))
        loop = asyncio.get_running_loop()
        until = loop.time() + self._call_timeout if self._call_timeout else None
        method, current = "POST", url
        payload: bytes | None = body
        for hop in range(_MAX_REDIRECTS + 1):
            left = None if until is None else max(0.001, until - loop.time())
            status, data, location = await self._exchange(method, current, payload, sent, left)
            if status not in _REDIRECTS or not location:
                return Outcome(status, data)
            try:
                current = urljoin(current, location)
            except ValueError as exc:
                raise GraphFailure(
                    500, f'Post "{current}": failed to parse Location header "{location}": {exc}'
                ) from None
            if hop == _MAX_REDIRECTS - 1:
                raise GraphFailure(500, f'Post "{current}": stopped after {_MAX_REDIRECTS} redirects')
            if status in (301, 302, 303):
                method, payload = "GET", None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _exchange(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: list[tuple[str, str]],
        deadline: float | None,
    ) -> tuple[int, bytes, str | None]:
        """One request; errors worded as Go's client words them (its Op is the first method)."""
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError as exc:
            raise GraphFailure(500, f'parse "{url}": {exc}') from None
        if not parts.scheme:
            raise GraphFailure(500, f'Post "{url}": unsupported protocol scheme ""')
        if parts.scheme not in ("http", "https"):
            raise GraphFailure(500, f'Post "{url}": unsupported protocol scheme "{parts.scheme}"')
        if not parts.hostname or any(c in parts.netloc for c in "{}$ "):
            bad = next((c for c in parts.netloc if c in "{}$ "), "")
            raise GraphFailure(500, f'parse "{url}": invalid character "{bad}" in host name')
        scheme = "http" if parts.scheme == "https" and await self.in_mesh() else parts.scheme
        origin = f"{scheme}://{parts.netloc}"
        # Percent-encode what may not stand in a request line (spaces, non-ASCII), as Go does.
        path = quote(parts.path or "/", safe=_PATH_SAFE) + (
            f"?{quote(parts.query, safe=_QUERY_SAFE)}" if parts.query else ""
        )
        sent = headers if body is not None else [(n, v) for n, v in headers if n.lower() != "content-type"]
        try:
            response = await self._client.request(origin, method, path, sent, body, deadline)
            data = await response.read()
        except UpstreamTimeout:
            raise GraphFailure(
                500,
                f'Post "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)',
            ) from None
        except ModelyardError as exc:
            raise GraphFailure(500, f'Post "{url}": {_go_reason(exc, parts.hostname, parts.port)}') from None
        return response.status, data, response.header("Location")


def _go_reason(exc: ModelyardError, host: str, port: int | None) -> str:
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED:
        return f"dial tcp {host}:{port or 80}: connect: connection refused"
    return exc.message
