"""`SimWorker`: one simulated server on a real socket, startable inside any running event loop."""

from __future__ import annotations

from types import TracebackType

from modelyard.config import ListenConfig, TlsServerConfig
from modelyard.rpc import OipServer
from modelyard.serving import HttpServer
from modelyard.simworker.app import ENGINE, PUBLISHER, create_sim_app
from modelyard.simworker.config import SimWorkerConfig
from modelyard.simworker.engine import SimStats
from modelyard.simworker.oip_grpc import SimOip

_MAX_GRPC_MESSAGE = 16 * 1024 * 1024  # as the REST app's client_max_size


class SimWorker:
    """Binds `config.host:config.port` (port 0 picks a free one) on `start()`, and OIP over gRPC on
    `config.grpc_port` when set (`grpc_url` then says where). With `tls` it serves HTTPS and gRPC
    over TLS (`url` https://, `grpc_url` grpcs://), from certificate files reloaded when they change.
    With `config.kv_events_port` it publishes KV-cache events (`kv_events_url`, `kv_replay_url`).

    Usable as `async with SimWorker(config) as worker:`; several can share one event loop.
    """

    def __init__(
        self,
        config: SimWorkerConfig | None = None,
        *,
        shutdown_timeout: float = 2.0,
        tls: TlsServerConfig | None = None,
    ) -> None:
        self.config = config or SimWorkerConfig()
        self.tls = tls
        self.app = create_sim_app(self.config)
        self.url: str | None = None
        self.port: int | None = None
        self.grpc_url: str | None = None
        self._shutdown_timeout = shutdown_timeout
        self._server: HttpServer | None = None
        self._grpc: OipServer | None = None

    @property
    def stats(self) -> SimStats:
        return self.app[ENGINE].stats

    @property
    def live_config(self) -> SimWorkerConfig:
        """The config in force now, including `PUT /sim/config` changes."""
        return self.app[ENGINE].config

    @property
    def kv_events_url(self) -> str | None:
        """`tcp://HOST:PORT` of the KV-cache events once started; None when off."""
        publisher = self.app.get(PUBLISHER)
        return publisher.events_url if publisher is not None else None

    @property
    def kv_replay_url(self) -> str | None:
        publisher = self.app.get(PUBLISHER)
        return publisher.replay_url if publisher is not None else None

    @property
    def server(self) -> HttpServer:
        """The running server (for `modelyard.serving.serve_until_signal`)."""
        if self._server is None:
            raise RuntimeError("SimWorker not started")
        return self._server

    async def start(self) -> str:
        if self._server is not None:
            raise RuntimeError("SimWorker already started")
        listen = ListenConfig(
            host=self.config.host,
            port=self.config.port,
            # aiohttp's own keep-alive (an hour), as before: the gateway's pools decide when to let go.
            keepalive_timeout=3630.0,
            drain_seconds=0.0,  # nothing routes by a sim worker's readiness: stop at once
            shutdown_timeout=self._shutdown_timeout,
            tls=self.tls,
        )
        # handler_cancellation (the default): a client that goes away aborts its generation, as vLLM does.
        server = HttpServer(self.app, listen)
        await server.start()
        self._server = server
        self.port = server.port
        self.url = server.url
        if self.config.grpc_port is not None:
            grpc = OipServer(
                SimOip(self.app),
                self.config.host,
                self.config.grpc_port,
                max_message_bytes=_MAX_GRPC_MESSAGE,
                tls=self.tls,
            )
            try:
                await grpc.start()
            except BaseException:
                await self.stop()
                raise
            self._grpc = grpc
            self.grpc_url = f"{'grpcs' if self.tls is not None else 'grpc'}://{grpc.address}"
        return server.url

    async def stop(self) -> None:
        grpc, self._grpc = self._grpc, None
        if grpc is not None:
            await grpc.stop(grace=0)
        server, self._server = self._server, None
        if server is not None:
            await server.stop()

    async def __aenter__(self) -> SimWorker:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
