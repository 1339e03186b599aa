"""The serving layer on uvloop, the event loop `modelyard serve` runs on; the other tests run on
asyncio's. uvloop's transports are not `asyncio.Transport` subclasses: code that checks for one
works on asyncio's loop and fails in production (a refused connection was reset, with a traceback,
instead of answered 503). These tests run their own uvloop loop (`uvloop.run`)."""

from __future__ import annotations

import asyncio

import uvloop

from modelyard.config import validate_config
from modelyard.gateway import start_gateway
from modelyard.simworker import SimWorker, SimWorkerConfig
from raw_http import Client, closed_by_server, request
from support import model_config


def test_connections_over_max_connections_get_503_on_uvloop():
    async def scenario() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        worker = SimWorker(SimWorkerConfig(port=0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0))
        await worker.start()
        config = {"listen": {"host": "127.0.0.1", "port": 0, "max_connections": 2}}
        clients: list[Client] = []
        gateway = None
        try:
            gateway = await start_gateway(
                validate_config({**config, "models": [model_config("m", [worker])]}, "<t>")
            )
            for _ in range(2):
                clients.append(await Client.connect(gateway.url))
                assert (await clients[-1].exchange(request("GET", "/healthz"))).status == 200
            clients.append(await Client.connect(gateway.url))
            reply = await clients[-1].exchange(request("GET", "/healthz"))
            assert reply.status == 503 and reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "too_many_connections"
            assert await closed_by_server(clients[-1].reader)
        finally:
            for client in clients:
                client.close()
            if gateway is not None:
                await gateway.stop()
            await worker.stop()

    uvloop.run(asyncio.wait_for(scenario(), 30))
