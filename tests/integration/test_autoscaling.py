"""Autoscaling end to end (issue 9 item 5): a scheduler with short scaling windows, two sim-workers in
repository mode with an agent each (replicas 0 and 1 of server `sim`), and a gateway following the
feed. A burst through the gateway keeps the lag above the threshold: the model goes from 1 to 2
replicas, every request answered; once the burst stops and the model is idle, it goes back to 1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from modelyard.agent import Agent, AgentConfig, start_agent
from modelyard.config import validate_config
from modelyard.gateway import RunningGateway, start_gateway
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from support import free_ports, metric_value, scheduler_model, wait_for_model, wait_until

MB = 1_000_000
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10}


@dataclass
class Stack:
    scheduler: RunningScheduler
    gateway: RunningGateway
    agents: list[Agent]
    http: aiohttp.ClientSession

    async def model(self, name: str) -> dict[str, Any]:
        return await scheduler_model(self.http, self.scheduler.url, name)

    async def wait_for(self, name: str, check: Any, what: str, within: float = 30) -> dict[str, Any]:
        return await wait_for_model(self.http, self.scheduler.url, name, check, what, within)


def available(model: dict[str, Any]) -> list[str]:
    """The replica indexes where the latest version is Available."""
    latest = model["versions"][-1]
    return sorted(i for i, r in latest["replicas"].items() if r["state"] == "Available")


@pytest.fixture
async def stack(sim_workers: Any, tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[Stack]:
    rest_port, agent_port = free_ports(2)
    config = SchedulerConfig(
        port=rest_port,
        agent_port=agent_port,
        db=":memory:",
        scale_up_lag=3,  # more than 3 requests in flight per replica...
        scale_up_window=0.5,  # ...for half a second adds a replica
        scale_down_inactivity=1.0,
        scale_down_cooldown=1.0,
        scaling_interval=0.1,
    )
    scheduler = await start_scheduler(config)
    gateway = await start_gateway(
        validate_config(
            {"listen": {"host": "127.0.0.1", "port": 0}, "placement": {"scheduler": scheduler.url}}, "<test>"
        )
    )
    agents: list[Agent] = []
    try:
        for index in range(2):
            # Each request decodes 10 tokens at 20 ms: about 0.2 s, so a burst of 12 keeps the lag up.
            (worker,) = await sim_workers(1, repository_api=True, decode_ms_per_token=20.0)
            agents.append(
                await start_agent(
                    AgentConfig(
                        scheduler=scheduler.agent_address,
                        server_name="sim",
                        replica_idx=index,
                        inference_url=worker.url,
                        memory_bytes=10 * MB,
                        unload_grace=0.2,
                        stats_interval=0.1,
                    )
                )
            )
        stack = Stack(scheduler, gateway, agents, http)

        async def connected() -> bool:
            async with http.get(f"{scheduler.url}/v1/servers") as response:
                servers = (await response.json())["servers"]
            return sum(1 for s in servers for r in s["replicas"] if r["connected"]) == 2

        await wait_until(connected, attempts=300, interval=0.05)
        yield stack
    finally:
        for agent in agents:
            await agent.stop()
        await gateway.stop()
        await scheduler.stop()


async def test_a_burst_scales_a_model_up_and_idleness_scales_it_back_down(stack: Stack) -> None:
    body = {
        "name": "m",
        "storage_uri": "sim://m",
        "memory": MB,
        "replicas": 1,
        "min_replicas": 1,
        "max_replicas": 2,
    }
    async with stack.http.put(f"{stack.scheduler.url}/v1/models/m", json=body) as response:
        assert response.status == 200
    first = await stack.wait_for("m", lambda m: m["state"] == "ModelAvailable", "Available")
    assert len(available(first)) == 1

    statuses: list[int] = []
    stop = asyncio.Event()
    deadline = time.monotonic() + 30  # bounded, whatever happens

    async def client() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            async with stack.http.post(f"{stack.gateway.url}/v1/chat/completions", json=CHAT) as response:
                await response.read()
                statuses.append(response.status)

    burst = [asyncio.create_task(client()) for _ in range(12)]
    try:
        scaled = await stack.wait_for(
            "m",
            lambda m: (
                m["spec"]["replicas"] == 2 and m["state"] == "ModelAvailable" and len(available(m)) == 2
            ),
            "a scale-up to 2 Available replicas",
        )
        # The gateway sends the burst to the new replica too, once it is Available there.
        added = [a for a in stack.agents if a.state.get("m") is not None]
        assert len(added) == 2

        async def both_serve() -> bool:
            counts = [
                await metric_value(stack.http, a.url, "modelyard_agent_requests_total", model="m", code="200")
                for a in added
            ]
            return min(counts) > 0

        await wait_until(both_serve, attempts=200, interval=0.05)
    finally:
        stop.set()
        await asyncio.gather(*burst)
    assert statuses and set(statuses) == {200}, [s for s in statuses if s != 200][:5]
    assert scaled["versions"][-1]["version"] == 1  # scaled in place: no new version

    down = await stack.wait_for(
        "m", lambda m: m["spec"]["replicas"] == 1 and len(available(m)) == 1, "a scale-down to 1 replica"
    )
    assert down["state"] == "ModelAvailable"
    scheduler = stack.scheduler.url
    assert await metric_value(stack.http, scheduler, "modelyard_scaling_events_total", direction="up") == 1
    assert await metric_value(stack.http, scheduler, "modelyard_scaling_events_total", direction="down") == 1
    assert (
        await metric_value(stack.http, scheduler, "modelyard_model_replicas", model="m", kind="desired") == 1
    )
    print(f"autoscaling: {len(statuses)} requests in the burst, all 200")
