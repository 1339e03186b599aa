"""The agent's test rig: a fake scheduler (an AgentService servicer that records subscribes and
events and lets a test send operations), a model source directory as a storageUri holds it, and
the `scheduler` and `setup` fixtures (registered by tests/integration/conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from modelyard.agent import Agent, AgentConfig, start_agent
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc
from support import wait_until

Event = agent_pb2.ModelEvent
OIP_BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


class FakeScheduler(agent_pb2_grpc.AgentServiceServicer):
    """Records subscribes and events; `send` puts an operation on the current stream, `drop` ends it."""

    def __init__(self) -> None:
        self.subscribes: list[agent_pb2.SubscribeRequest] = []
        self.events: list[agent_pb2.ModelEvent] = []
        self._queue: asyncio.Queue[agent_pb2.ModelOperation | None] | None = None

    async def Subscribe(self, request, context):  # type: ignore[override]
        queue: asyncio.Queue[agent_pb2.ModelOperation | None] = asyncio.Queue()
        self._queue = queue
        self.subscribes.append(request)
        while (operation := await queue.get()) is not None:
            yield operation

    async def AgentEvent(self, request, context):  # type: ignore[override]
        self.events.append(request)
        return agent_pb2.ModelEventResponse()

    async def AgentDrain(self, request, context):  # type: ignore[override]
        return agent_pb2.AgentDrainResponse(success=True)

    def send(self, kind: int, name: str, version: int = 1, **fields: Any) -> None:
        assert self._queue is not None, "no agent subscribed"
        model = agent_pb2.ModelVersion(name=name, version=version, **fields)
        self._queue.put_nowait(agent_pb2.ModelOperation(operation=kind, model_version=model))

    def drop(self) -> None:
        assert self._queue is not None
        self._queue.put_nowait(None)

    async def event(
        self, name: str, kind: int, version: int = 1, count: int = 1, within: float = 10.0
    ) -> agent_pb2.ModelEvent:
        """The count-th event of this kind for this model version, once it has arrived."""

        def matching() -> list[agent_pb2.ModelEvent]:
            return [
                e for e in self.events if (e.model_name, e.model_version, e.event) == (name, version, kind)
            ]

        async def arrived() -> bool:
            return len(matching()) >= count

        await wait_until(arrived, attempts=int(within / 0.01))
        return matching()[count - 1]


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[FakeScheduler, str]]:
    fake = FakeScheduler()
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def model_source(root: Path, name: str = "iris", **extra: Any) -> Path:
    """A model directory as a storageUri would hold it (the sim reads memory and failure from it)."""
    src = root / "sources" / name
    src.mkdir(parents=True)
    (src / "model-settings.json").write_text(
        json.dumps({"name": "whatever", "parallel_workers": 2, "parameters": {"extra": extra}})
    )
    (src / "weights.bin").write_bytes(b"\0" * 64)
    return src


@pytest.fixture
async def setup(scheduler, sim_workers, tmp_path) -> AsyncIterator[Callable[..., Any]]:
    """`await setup(worker={sim-worker config}, **agent_config)`: a repository-mode sim-worker and a
    started agent over it."""
    fake, target = scheduler
    agents: list[Agent] = []
    repo = tmp_path / "repo"
    repo.mkdir()
    root = tmp_path

    async def start(
        worker: dict[str, Any] | None = None, **overrides: Any
    ) -> tuple[FakeScheduler, Agent, Any]:
        (sim,) = await sim_workers(1, repository=repo, **(worker or {}))
        settings = {
            "scheduler": target,
            "server_name": "sim",
            "replica_idx": 3,
            "inference_url": sim.url,
            "memory_bytes": 1000,
            "capabilities": ("sim", "sklearn"),
            "overcommit_percent": 10,
            "repository": repo,
            "unload_grace": 0.0,
            "load_attempts": 3,
            "load_backoff": 0.01,
            "load_backoff_max": 0.02,
            "reconnect_backoff": 0.05,
            "reconnect_backoff_max": 0.2,
            "fetch_roots": (root / "sources",),  # where model_source puts the test's models
            **overrides,
        }
        agent = await start_agent(AgentConfig(**settings))
        agents.append(agent)

        async def subscribed() -> bool:
            return len(fake.subscribes) >= 1

        await wait_until(subscribed, attempts=1000)
        return fake, agent, sim

    yield start
    for agent in agents:
        await agent.stop()
