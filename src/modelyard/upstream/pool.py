"""Upstream calls for the gateway: forwarding and health probes over keep-alive pools."""

from __future__ import annotations

from collections.abc import Coroutine, Iterable
from typing import Any
from urllib.parse import urlsplit

from modelyard.config import GatewayConfig, TlsClientConfig, UpstreamConfig
from modelyard.errors import ModelyardError
from modelyard.protocols.http import RawHeaders
from modelyard.security.tls import ClientTls
from modelyard.upstream.headers import NOT_RELAYED
from modelyard.upstream.http1 import Flight, Http1Client, TlsUrl, UpstreamResponse, system_tls

_SECURE = frozenset({"https", "grpcs"})


class UpstreamTls:
    """TLS to upstream servers: the default for https:// and grpcs:// URLs without settings of
    their own (`upstream.tls`, else the system's CAs), and one `ClientTls` per distinct setting of a
    model or an endpoint, whose files are checked when it is made (a `TlsError` naming the file)
    and read again when they change. `url()` gives the URL a request is sent to: the same object
    for the same URL and settings, so that a client's pool is found by identity."""

    def __init__(self, default: TlsClientConfig | None) -> None:
        self._default = ClientTls(default) if default is not None else None  # its files checked now
        self._clients: dict[TlsClientConfig, ClientTls] = {}
        self._urls: dict[tuple[str, TlsClientConfig], TlsUrl] = {}

    def default(self) -> ClientTls:
        if self._default is None:
            self._default = system_tls()  # made when first needed: most gateways never need it
        return self._default

    def client(self, config: TlsClientConfig) -> ClientTls:
        tls = self._clients.get(config)
        if tls is None:
            tls = self._clients[config] = ClientTls(config)
        return tls

    def url(self, url: str, config: TlsClientConfig | None) -> str:
        """`url` itself when `config` is None or it is plain http:// or grpc://; else a TlsUrl."""
        if config is None or not url or urlsplit(url).scheme not in _SECURE:
            return url
        key = (url, config)
        found = self._urls.get(key)
        if found is None:
            found = self._urls[key] = TlsUrl(url, self.client(config))
        return found


def check_upstream_tls(config: GatewayConfig) -> None:
    """Read every file the config's TLS to upstreams names (upstream.tls, each model's and each
    endpoint's): a TlsError naming the first that cannot be used. For a parent that starts
    workers, as for listen.tls: one line, not a traceback from each worker."""
    tls = UpstreamTls(config.upstream.tls)
    for model in config.models:
        for endpoint in model.endpoints:
            setting = endpoint.tls or model.tls
            if setting is not None:
                tls.client(setting)


class UpstreamPool:
    """`relay_drop`: the answer fields the caller does not pass on (`UpstreamResponse.relayed`).
    `tls`: the TLS settings to upstreams (made from `config.tls` when not given)."""

    def __init__(
        self,
        config: UpstreamConfig,
        relay_drop: frozenset[bytes] = NOT_RELAYED,
        tls: UpstreamTls | None = None,
    ) -> None:
        self._config = config
        self.relay_drop = relay_drop
        self.tls = tls if tls is not None else UpstreamTls(config.tls)
        self._client = Http1Client(
            max_connections=config.max_connections,
            connect_timeout=config.connect_timeout,
            relay_drop=relay_drop,
            tls=self.tls.default,
        )

    @property
    def client(self) -> Http1Client:
        return self._client

    def send(
        self,
        base_url: str,
        method: str,
        path: str,
        headers: RawHeaders | Iterable[tuple[str, str]],
        body: bytes | None,
        deadline: float | None = None,
        flight: Flight | None = None,
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """Send a request; the coroutine returns once the response head has arrived. `deadline`
        (seconds, for the whole exchange, body included) is capped by `upstream.timeout`; `flight`
        lets the caller abort it until then. The caller must `read()` the response or `close()` it.
        (Not a coroutine itself: one frame fewer on every request.)"""
        return self._client.request(base_url, method, path, headers, body, self.time_limit(deadline), flight)

    def time_limit(self, deadline: float | None) -> float | None:
        """Seconds an upstream exchange may take: `deadline` capped by `upstream.timeout`."""
        limit = self._config.timeout or None
        if deadline is not None:
            limit = min(limit, deadline) if limit else deadline
        return limit

    async def probe(self, base_url: str, path: str, deadline: float) -> str:
        """GET a health path; returns "" when healthy (2xx), else why not."""
        try:
            response = await self._client.request(base_url, "GET", path, (), None, deadline or None)
            await response.read()
        except ModelyardError as exc:
            return f"health check failed: {exc.message}"
        if 200 <= response.status < 300:
            return ""
        return f"health check answered {response.status}"

    async def close(self) -> None:
        self._client.close()
