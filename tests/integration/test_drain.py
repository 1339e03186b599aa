"""Draining a replica (compat §8) end to end: a scheduler, two sim-workers in repository mode with an
agent each (server `sim`), and a gateway following the scheduler, all in this process; and
`modelyard agent` as a process, drained by SIGTERM.

Replica 0 offers 4000 bytes and replica 1 8000, so a model of 1000 bytes with one replica lands
on replica 1 (more free memory), and one of 5000 fits only there. A drain is what a SIGTERM to the
agent does (`Agent.drain`); then the agent and its sim-worker stop, as the pod would die.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from modelyard.agent import Agent, AgentConfig, start_agent
from modelyard.config import validate_config
from modelyard.gateway import GATEWAY, RunningGateway, start_gateway
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from modelyard.simworker import SimWorker, SimWorkerConfig
from support import free_ports, wait_until

MEMORY = (4000, 8000)  # replica 0, replica 1
OIP_BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
LOAD_DELAY = 0.3  # seconds a sim-worker takes to load a model: the drain waits for it
LOAD_SECONDS = 60.0  # the most a load loop runs, whatever happens


@dataclass
class Stack:
    scheduler: RunningScheduler
    gateway: RunningGateway
    http: aiohttp.ClientSession
    workers: list[SimWorker | None] = field(default_factory=lambda: [None, None])
    agents: list[Agent | None] = field(default_factory=lambda: [None, None])

    def agent_config(self, index: int) -> AgentConfig:
        worker = self.workers[index]
        assert worker is not None and worker.url is not None
        return AgentConfig(
            scheduler=self.scheduler.agent_address,
            server_name="sim",
            replica_idx=index,
            inference_url=worker.url,
            memory_bytes=MEMORY[index],
            capabilities=("sim",),  # type: ignore[arg-type]
            unload_grace=0,
            server_live_timeout=10,
        )

    async def apply(self, name: str, **spec: Any) -> None:
        body = {"name": name, "storage_uri": "sim:", "requirements": ["sim"], "memory": 1000, **spec}
        async with self.http.put(f"{self.scheduler.url}/v1/models/{name}", json=body) as response:
            assert response.status == 200, await response.text()

    async def model(self, name: str) -> dict[str, Any]:
        async with self.http.get(f"{self.scheduler.url}/v1/models/{name}") as response:
            assert response.status == 200, await response.text()
            return dict(await response.json())

    async def wait_replicas(self, name: str, replicas: dict[str, str], state: str = "ModelAvailable") -> None:
        seen: dict[str, Any] = {}

        async def reached() -> bool:
            seen.update(await self.model(name))
            return bool(seen["state"] == state and replicas_of(seen) == replicas)

        try:
            await wait_until(reached, attempts=600, interval=0.05)
        except AssertionError:
            raise AssertionError(f"{name}: never {state} on {replicas}; last: {seen}") from None

    async def infer(self, name: str) -> tuple[int, str]:
        """The status and the endpoint that answered (X-Modelyard-Backend)."""
        url = f"{self.gateway.url}/v2/models/{name}/infer"
        async with self.http.post(url, json=OIP_BODY) as response:
            await response.read()
            return response.status, response.headers.get("X-Modelyard-Backend", "")

    async def routed(self, name: str, backends: set[str]) -> None:
        """Wait until the gateway routes `name` to exactly `backends` (by the feed it follows)."""

        async def there() -> bool:
            model = self.gateway.app[GATEWAY].placed.models.get(name)
            return model is not None and {e.name for e in model.endpoints} == backends

        await wait_until(there, attempts=400, interval=0.05)

    async def stop_replica(self, index: int) -> None:
        """The pod dies: the agent goes, then its server."""
        agent, self.agents[index] = self.agents[index], None
        if agent is not None:
            await agent.stop()
        worker, self.workers[index] = self.workers[index], None
        if worker is not None:
            await worker.stop()


def replicas_of(model: dict[str, Any]) -> dict[str, str]:
    return {index: r["state"] for index, r in model["versions"][-1]["replicas"].items()}


@pytest.fixture
async def stack(tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[Stack]:
    rest_port, agent_port = free_ports(2)
    scheduler = await start_scheduler(
        SchedulerConfig(port=rest_port, agent_port=agent_port, db=str(tmp_path / "s.db"), retry_interval=1.0)
    )
    gateway = await start_gateway(
        validate_config(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "placement": {"scheduler": scheduler.url, "reconnect_max_interval": "1s"},
            },
            "<test>",
        )
    )
    stack = Stack(scheduler, gateway, http)
    try:
        for index in range(2):
            worker = SimWorker(
                SimWorkerConfig(
                    port=0,
                    repository_api=True,
                    seed=index,
                    prefill_ms_per_token=0.0,
                    decode_ms_per_token=0.0,
                    load_delay=LOAD_DELAY,
                )
            )
            await worker.start()
            stack.workers[index] = worker
            stack.agents[index] = await start_agent(stack.agent_config(index))

        async def connected() -> bool:
            server = scheduler.state.servers.get("sim")
            return server is not None and sum(r.connected for r in server.replicas.values()) == 2

        await wait_until(connected, attempts=400, interval=0.05)
        yield stack
    finally:
        for index in range(2):
            await stack.stop_replica(index)
        await gateway.stop()
        await scheduler.stop()


class Load:
    """Steady traffic: one loop per model sending requests back to back through the gateway, each
    bounded by LOAD_SECONDS; every answer's (status, backend) is kept."""

    def __init__(self, stack: Stack, names: list[str]) -> None:
        self.answers: dict[str, list[tuple[int, str]]] = {name: [] for name in names}
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._loop(stack, name)) for name in names]

    async def _loop(self, stack: Stack, name: str) -> None:
        deadline = time.monotonic() + LOAD_SECONDS
        while not self._stop.is_set() and time.monotonic() < deadline:
            self.answers[name].append(await stack.infer(name))

    @property
    def total(self) -> int:
        return sum(len(seen) for seen in self.answers.values())

    async def more(self, count: int) -> None:
        """Wait until every model has had `count` more answers."""
        wanted = {name: len(seen) + count for name, seen in self.answers.items()}

        async def enough() -> bool:
            return all(len(self.answers[name]) >= n for name, n in wanted.items())

        await wait_until(enough, attempts=2000, interval=0.01)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def failed(self) -> list[tuple[str, int, str]]:
        return [(name, s, b) for name, seen in self.answers.items() for s, b in seen if s != 200]


async def test_drain_under_steady_load_fails_no_request(stack: Stack) -> None:
    await stack.apply("both", replicas=2, min_replicas=1)
    await stack.apply("one-a")
    await stack.apply("one-b")
    await stack.wait_replicas("both", {"0": "Available", "1": "Available"})
    for name in ("one-a", "one-b"):
        await stack.wait_replicas(name, {"1": "Available"})
    await stack.routed("one-a", {"sim-1"})
    await stack.routed("one-b", {"sim-1"})
    await stack.routed("both", {"sim-0", "sim-1"})

    load = Load(stack, ["both", "one-a", "one-b"])
    try:
        await load.more(20)
        before = load.total
        agent = stack.agents[1]
        assert agent is not None
        started = time.monotonic()
        drained = await agent.drain(deadline=30)  # what SIGTERM does
        took = time.monotonic() - started
        assert drained is True
        assert agent.draining
        assert took >= LOAD_DELAY  # it waited for one-a and one-b to load on replica 0
        during = load.total - before
        await load.more(20)
        await stack.stop_replica(1)  # the pod dies only now
        await load.more(20)
    finally:
        await load.stop()

    assert load.failed() == []
    for name in ("both", "one-a", "one-b"):
        await stack.wait_replicas(name, {"0": "Available"})
        assert load.answers[name][-1] == (200, "sim-0")
    print(f"\ndrain took {took:.2f}s; requests during it: {during}; in all: {load.total}, failed: 0")


async def test_a_model_that_cannot_move_answers_the_drain_at_once_and_serves_until_the_replica_goes(
    stack: Stack,
) -> None:
    await stack.apply("small")  # replica 1: more free memory
    await stack.wait_replicas("small", {"1": "Available"})
    await stack.apply("big", memory=5000)  # fits only replica 1
    await stack.wait_replicas("big", {"1": "Available"})
    await stack.wait_replicas("small", {"1": "Available"})
    await stack.routed("big", {"sim-1"})

    load = Load(stack, ["big"])
    try:
        await load.more(10)
        agent = stack.agents[1]
        assert agent is not None
        started = time.monotonic()
        assert await agent.drain(deadline=30) is True
        took = time.monotonic() - started
        assert took < 10, took  # not the timeout: it answers as soon as `small` serves on 0
        big = await stack.model("big")
        assert (big["state"], replicas_of(big)) == ("ScheduleFailed", {"1": "Draining"})
        await stack.wait_replicas("small", {"0": "Available", "1": "Draining"})
        await load.more(10)  # still served by the draining replica
        assert load.failed() == []
        assert load.answers["big"][-1] == (200, "sim-1")
        await stack.stop_replica(1)
        await stack.wait_replicas("big", {}, state="ScheduleFailed")
        status, _ = await stack.infer("big")
        assert status == 503  # nowhere to go now, and the gateway says so
    finally:
        await load.stop()
    print(f"\ndrain with a model that cannot move took {took:.2f}s")


async def test_sigterm_drains_a_modelyard_agent_process_and_it_exits_0(stack: Stack) -> None:
    # Replica 1's in-process agent makes way for a `modelyard agent` process over the same server.
    agent = stack.agents[1]
    assert agent is not None and stack.workers[1] is not None
    await agent.stop()
    stack.agents[1] = None

    async def gone() -> bool:
        return 1 not in stack.scheduler.state.servers["sim"].replicas

    await wait_until(gone, attempts=400, interval=0.05)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "agent", "--scheduler", stack.scheduler.agent_address,
        "--server", "sim", "--replica", "1", "--inference-url", str(stack.workers[1].url),
        "--memory", str(MEMORY[1]), "--capabilities", "sim", "--unload-grace", "0",
        "--drain-timeout", "30",
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        async def subscribed() -> bool:
            replica = stack.scheduler.state.servers["sim"].replicas.get(1)
            return (replica is not None and replica.connected) or process.returncode is not None

        await wait_until(subscribed, attempts=600, interval=0.05)
        assert process.returncode is None
        await stack.apply("moving")
        await stack.wait_replicas("moving", {"1": "Available"})

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert process.stderr is not None
        logged = (await process.stderr.read()).decode()
        assert "draining: not ready for new models" in logged, logged
        assert "drained in" in logged, logged
        await stack.wait_replicas("moving", {"0": "Available"})  # the replica went with the agent
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
