"""The embedded demo's placement part in-process on free ports: examples/placement/models.yaml
applied through the scheduler client, placed by real agents on sim-workers, routed by the demo
gateway."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from modelyard.cli.demo import demo_config, start_demo_workers
from modelyard.cli.demo_placement import DemoPlacement, start_demo_placement
from modelyard.documents import parse_documents
from modelyard.errors import ModelyardError
from modelyard.gateway import RunningGateway, start_gateway
from modelyard.placement.manifest import spec_to_plain, specs_from_manifests
from modelyard.rpc import AgentServer
from modelyard.upstream.scheduler_client import SchedulerClient
from support import wait_until

MODELS = Path(__file__).parents[2] / "examples" / "placement" / "models.yaml"
README = Path(__file__).parents[2] / "README.md"


@pytest.fixture
async def demo() -> AsyncIterator[tuple[DemoPlacement, RunningGateway]]:
    placement = await start_demo_placement(port=0, agent_port=0)
    workers = await start_demo_workers()
    gateway = await start_gateway(demo_config(workers, {"listen": {"port": 0}}, placement))
    yield placement, gateway
    await gateway.stop()
    await placement.stop()
    for _name, worker in workers:
        await worker.stop()


async def chat(http: aiohttp.ClientSession, gateway: RunningGateway, model: str) -> tuple[int, Any, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 2}
    async with http.post(gateway.url + "/v1/chat/completions", json=body) as response:
        return response.status, response.headers, await response.json()


async def test_the_example_models_are_placed_by_memory_and_served_through_the_gateway(demo, http):
    placement, gateway = demo
    specs = specs_from_manifests(parse_documents(MODELS.read_text(), untrusted=False), str(MODELS))
    async with SchedulerClient(placement.url) as scheduler:
        for spec in specs:
            await scheduler.apply(spec_to_plain(spec), spec.name)

        async def settled() -> bool:
            states = {m["name"]: m["state"] for m in await scheduler.list()}
            return states == {
                "chat-small": "ModelAvailable",
                "chat-large": "ModelAvailable",
                "chat-huge": "ScheduleFailed",
            }

        await wait_until(settled, attempts=200, interval=0.05)
        (server,) = await scheduler.servers()
        loaded = {r["index"]: sorted(r["loaded_models"]) for r in server["replicas"]}
        assert loaded == {0: ["chat-small"], 1: ["chat-large", "chat-small"]}  # 6Gi fits only the 8Gi one
        huge = await scheduler.get("chat-huge")

        async def routable() -> bool:
            return (await chat(http, gateway, "chat-large"))[0] == 200

        await wait_until(routable, attempts=200, interval=0.02)  # the feed reached the gateway
        status, headers, body = await chat(http, gateway, "chat-large")
        assert (status, headers["X-Modelyard-Backend"]) == (200, "sim-1"), body
        assert body["model"] == "chat-large"
        backends = {(await chat(http, gateway, "chat-small"))[1]["X-Modelyard-Backend"] for _ in range(30)}
        assert backends <= {"sim-0", "sim-1"} and backends

        status, headers, body = await chat(http, gateway, "chat-huge")
        assert status == 503 and headers["Retry-After"]
        assert "ScheduleFailed" in body["error"]["message"] and huge["reason"] in body["error"]["message"]

        await scheduler.delete("chat-small")

        async def gone() -> bool:
            return (await chat(http, gateway, "chat-small"))[0] == 404

        await wait_until(gone, attempts=200, interval=0.02)
        # The README shows this answer: chat-huge is known (it answers 503 while it cannot be placed).
        _, _, body = await chat(http, gateway, "chat-small")
        assert f'{{"error":{{"message":"{body["error"]["message"]}",' in README.read_text()
        assert body["error"]["message"] == (
            "model 'chat-small' not found; known models: chat-huge, chat-large, demo-echo, demo-llm"
        )


async def test_a_port_in_use_is_named_in_one_line():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        named = rf"127\.0\.0\.1:{port} \(its agent port\) is already in use"
        with pytest.raises(ModelyardError, match=named):
            await start_demo_placement(port=0, agent_port=port)


async def test_a_second_agent_server_on_a_port_in_use_fails_instead_of_sharing_it():
    first = AgentServer(handler=None, port=0)  # type: ignore[arg-type]  # never called
    await first.start()
    try:
        with pytest.raises(OSError, match="address in use"):
            await AgentServer(handler=None, port=first.port).start()  # type: ignore[arg-type]
    finally:
        await first.stop()
