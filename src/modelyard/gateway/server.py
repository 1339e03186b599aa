"""Running the gateway: in-process (tests, the embedded demo) or as the `serve` command."""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from modelyard.config import GatewayConfig
from modelyard.gateway.app import create_app
from modelyard.graph import Graph
from modelyard.state import SharedState


class RunningGateway:
    """A gateway bound to a socket; `url` is where it answers."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self.runner = runner
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    @property
    def app(self) -> web.Application:
        return self.runner.app

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_gateway(
    config: GatewayConfig,
    *,
    state: SharedState | None = None,
    seed: int | None = None,
    graphs: dict[str, Graph] | None = None,
) -> RunningGateway:
    app = create_app(config, state=state, seed=seed, graphs=graphs)
    # handler_cancellation: a client that disconnects cancels its handler, and so its upstream call.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.listen.host, config.listen.port, backlog=1024)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return RunningGateway(runner, config.listen.host, runner.addresses[0][1])


async def run_until_signal(
    start: Callable[[], Awaitable[object]], stop: Callable[[], Awaitable[None]]
) -> None:
    """Start, wait for SIGINT/SIGTERM, then stop cleanly."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await start()
    _settle_garbage_collector()
    try:
        await stopping.wait()
    finally:
        await stop()


def _settle_garbage_collector() -> None:
    """Move everything built at start-up out of the collector's view and collect less often: the
    request path allocates many short-lived objects, and full collections that walk the whole
    heap were the gateway's tail latency under load."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def run(main: Awaitable[None]) -> None:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)  # type: ignore[arg-type]
    else:
        uvloop.run(main)  # type: ignore[arg-type]
