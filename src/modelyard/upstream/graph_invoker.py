"""Graph steps over HTTP: POST the step's bytes to its service URL, as KServe's router does.

Only status and body come back (KServe discards upstream headers); a call with no answer becomes
a graph failure whose cause reads like the Go client's error, so that answers match KServe's.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from modelyard.errors import ModelyardError, UpstreamTimeout
from modelyard.graph import GraphFailure, InferenceStep, Outcome
from modelyard.upstream.http1 import Http1Client


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
        parts = urlsplit(url)
        if not parts.scheme:
            raise GraphFailure(500, f'Post "{url}": unsupported protocol scheme ""')
        if parts.scheme not in ("http", "https"):
            raise GraphFailure(500, f'Post "{url}": unsupported protocol scheme "{parts.scheme}"')
        try:
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            raise GraphFailure(500, f'parse "{url}": invalid port') from None
        if not parts.hostname or any(c in parts.netloc for c in "{}$ "):
            bad = next((c for c in parts.netloc if c in "{}$ "), "")
            raise GraphFailure(500, f'parse "{url}": invalid character "{bad}" in host name')
        scheme = "http" if parts.scheme == "https" and await self.in_mesh() else parts.scheme
        origin = f"{scheme}://{parts.netloc}"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = list(headers)
        if not any(name.lower() == "content-type" for name, _ in sent):
            sent.append(("Content-Type", "application/json"))
        try:
            response = await self._client.request(origin, "POST", path, sent, body, self._call_timeout)
            data = await response.read()
        except UpstreamTimeout:
            raise GraphFailure(
                500,
                f'Post "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)',
            ) from None
        except ModelyardError as exc:
            raise GraphFailure(500, f'Post "{url}": {_go_reason(exc, parts.hostname, parts.port)}') from None
        return Outcome(response.status, data)


def _go_reason(exc: ModelyardError, host: str, port: int | None) -> str:
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED:
        return f"dial tcp {host}:{port or 80}: connect: connection refused"
    return exc.message
