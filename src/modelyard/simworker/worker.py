"""`SimWorker`: one simulated server on a real socket, startable inside any running event loop."""

from __future__ import annotations

from types import TracebackType

from modelyard.config import ListenConfig
from modelyard.serving import HttpServer
from modelyard.simworker.app import ENGINE, create_sim_app
from modelyard.simworker.config import SimWorkerConfig
from modelyard.simworker.engine import SimStats


class SimWorker:
    """Binds `config.host:config.port` (port 0 picks a free one) on `start()`.

    Usable as `async with SimWorker(config) as worker:`; several can share one event loop.
    """

    def __init__(self, config: SimWorkerConfig | None = None, *, shutdown_timeout: float = 2.0) -> None:
        self.config = config or SimWorkerConfig()
        self.app = create_sim_app(self.config)
        self.url: str | None = None
        self.port: int | None = None
        self._shutdown_timeout = shutdown_timeout
        self._server: HttpServer | None = None

    @property
    def stats(self) -> SimStats:
        return self.app[ENGINE].stats

    @property
    def live_config(self) -> SimWorkerConfig:
        """The config in force now, including `PUT /sim/config` changes."""
        return self.app[ENGINE].config

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
        )
        # handler_cancellation (the default): a client that goes away aborts its generation, as vLLM does.
        server = HttpServer(self.app, listen)
        await server.start()
        self._server = server
        self.port = server.port
        self.url = server.url
        return server.url

    async def stop(self) -> None:
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
