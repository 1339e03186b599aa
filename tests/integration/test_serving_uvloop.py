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
from raw_http import Client, closed_by_server, read_reply, request
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


def test_tls_on_uvloop_lean_then_aiohttp_on_one_connection_and_silent_ones_bounded(tmp_path):
    """The TLS layer is uvloop's own, put on each connection by the listener: a lean request and
    then one aiohttp answers (the hand-off) on one TLS connection; connections that never shake
    hands are bounded by max_connections and closed past it."""
    from certificates import Pki

    pki = Pki(tmp_path)
    server = pki.issue()
    context = pki.client_context()

    async def scenario() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        worker = SimWorker(SimWorkerConfig(port=0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0))
        await worker.start()
        tls = {"cert_file": str(server.cert), "key_file": str(server.key)}
        listen = {"host": "127.0.0.1", "port": 0, "max_connections": 3, "header_timeout": 0.5, "tls": tls}
        gateway = await start_gateway(
            validate_config({"listen": listen, "models": [model_config("m", [worker])]}, "<t>")
        )
        try:
            port = gateway.server.port
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            chat = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'
            writer.write(request("POST", "/v1/chat/completions", chat))
            assert (await read_reply(reader)).status == 200  # the lean connection
            writer.write(request("GET", "/openapi.json"))  # not lean's: handed to aiohttp's
            assert (await read_reply(reader)).status == 200
            writer.close()
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(8)]
            dropped = await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in silent[3:]))
            assert dropped == [b""] * 5
            for _, w in silent:
                w.close()
        finally:
            await gateway.stop()
            await worker.stop()

    uvloop.run(asyncio.wait_for(scenario(), 30))
