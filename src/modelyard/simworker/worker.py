"""`SimWorker`: one simulated server on a real socket, startable inside any running event loop."""

from __future__ import annotations

from types import TracebackType

from aiohttp import web

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
        self._runner: web.AppRunner | None = None

    @property
    def stats(self) -> SimStats:
        return self.app[ENGINE].stats

    @property
    def live_config(self) -> SimWorkerConfig:
        """The config in force now, including `PUT /sim/config` changes."""
        return self.app[ENGINE].config

    async def start(self) -> str:
        if self._runner is not None:
            raise RuntimeError("SimWorker already started")
        # handler_cancellation: a client that goes away aborts its generation, as vLLM does.
        runner = web.AppRunner(
            self.app, access_log=None, shutdown_timeout=self._shutdown_timeout, handler_cancellation=True
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{_url_host(self.config.host or host)}:{port}"
        return self.url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> SimWorker:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
