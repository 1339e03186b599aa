"""Rollouts end to end (issue 9 item 4, compat §6.2): a scheduler, two sim-workers in repository
mode each with an agent (replicas 0 and 1 of server `sim`), and a gateway following the feed.

A model is applied (version 1 lands on replica 0), steady bounded load runs through the gateway,
then a new spec is applied: version 2 lands on replica 1 (the replica not serving the old version),
loads while version 1 serves, takes the traffic, and version 1 unloads after the agent's grace.
A version 2 that fails to load leaves version 1 serving, and the model says why.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from modelyard.agent import Agent, AgentConfig, start_agent
from modelyard.config import validate_config
from modelyard.gateway import GATEWAY, RunningGateway, start_gateway
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from support import free_ports, scheduler_model, wait_for_model, wait_until

MB = 1_000_000
OIP_BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


def model_source(root: Path, label: str, **extra: Any) -> Path:
    """A model directory (model-settings.json) that the agents copy into their sim-worker's repository."""
    source = root / "sources" / label
    source.mkdir(parents=True)
    settings = {"name": label, "parameters": {"extra": {"memory_bytes": 1000, **extra}}}
    (source / "model-settings.json").write_text(json.dumps(settings))
    return source


@dataclass
class Answers:
    """What the load loop saw: (status, backend, subset) per request, in order."""

    seen: list[tuple[int, str, str]] = field(default_factory=list)

    def enough(self, count: int) -> Any:
        async def reached() -> bool:
            return len(self.seen) >= count

        return reached

    @property
    def failed(self) -> list[tuple[int, str, str]]:
        return [answer for answer in self.seen if answer[0] != 200]


@dataclass
class Stack:
    scheduler: RunningScheduler
    gateway: RunningGateway
    workers: list[Any]
    agents: list[Agent]
    http: aiohttp.ClientSession
    feed: list[dict[str, Any]] = field(default_factory=list)  # the model lines the feed carried

    async def apply(self, name: str, source: Path, replicas: int = 1) -> dict[str, Any]:
        body = {"name": name, "storage_uri": str(source), "memory": MB, "replicas": replicas}
        async with self.http.put(f"{self.scheduler.url}/v1/models/{name}", json=body) as response:
            assert response.status == 200, await response.text()
            return dict(await response.json())

    async def model(self, name: str) -> dict[str, Any]:
        return await scheduler_model(self.http, self.scheduler.url, name)

    async def wait_for(self, name: str, check: Any, what: str, within: float = 30) -> dict[str, Any]:
        return await wait_for_model(self.http, self.scheduler.url, name, check, what, within)

    async def repository(self, index: int) -> dict[str, Any]:
        async with self.http.get(f"{self.workers[index].url}/sim/repository") as response:
            return dict(await response.json())

    async def follow_feed(self) -> None:
        async with self.http.get(
            f"{self.scheduler.url}/v1/feed", timeout=aiohttp.ClientTimeout()
        ) as response:
            async for line in response.content:
                data = orjson.loads(line) if line.strip() else {}
                if data.get("type") == "model":
                    self.feed.append(data)

    async def steady_load(self, name: str, answers: Answers, stop: asyncio.Event, workers: int = 2) -> None:
        """`workers` requests at a time until `stop` (bounded: 60 s and 20000 requests)."""
        deadline = time.monotonic() + 60
        url = f"{self.gateway.url}/v2/models/{name}/infer"

        async def one_worker() -> None:
            while not stop.is_set() and time.monotonic() < deadline and len(answers.seen) < 20_000:
                async with self.http.post(url, json=OIP_BODY) as response:
                    await response.read()
                    answers.seen.append(
                        (
                            response.status,
                            response.headers.get("X-Modelyard-Backend", ""),
                            response.headers.get("X-Modelyard-Subset", ""),
                        )
                    )

        await asyncio.gather(*(one_worker() for _ in range(workers)))


@pytest.fixture
async def stack(sim_workers: Any, tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[Stack]:
    rest_port, agent_port = free_ports(2)
    config = SchedulerConfig(
        port=rest_port, agent_port=agent_port, db=str(tmp_path / "scheduler.db"), retry_interval=30.0
    )
    scheduler = await start_scheduler(config)
    gateway = await start_gateway(
        validate_config(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "placement": {"scheduler": scheduler.url, "reconnect_max_interval": "1s"},
            },
            "<test>",
        )
    )
    workers, agents = [], []
    feed: asyncio.Task[None] | None = None
    try:
        for index in range(2):
            repository = tmp_path / f"repository-{index}"
            repository.mkdir()
            # The replica that gets the new version loads slowly: the old one serves meanwhile.
            (worker,) = await sim_workers(1, repository=repository, load_delay=0.5 * index)
            workers.append(worker)
            agents.append(
                await start_agent(
                    AgentConfig(
                        scheduler=scheduler.agent_address,
                        server_name="sim",
                        replica_idx=index,
                        inference_url=worker.url,
                        memory_bytes=10 * MB,
                        repository=repository,
                        unload_grace=0.5,  # requests sent to the old version before the switch finish
                        load_attempts=1,
                        fetch_roots=(tmp_path / "sources",),  # model_source's models, beside the repository
                    )
                )
            )
        stack = Stack(scheduler, gateway, workers, agents, http)

        async def connected() -> bool:
            async with http.get(f"{scheduler.url}/v1/servers") as response:
                servers = (await response.json())["servers"]
            return sum(1 for s in servers for r in s["replicas"] if r["connected"]) == 2

        await wait_until(connected, attempts=300, interval=0.05)
        feed = asyncio.create_task(stack.follow_feed())
        yield stack
    finally:
        if feed is not None:
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
        for agent in agents:
            await agent.stop()
        await gateway.stop()
        await scheduler.stop()


def versions_of(model: dict[str, Any]) -> dict[int, dict[str, str]]:
    """version -> {replica index: state}."""
    return {v["version"]: {i: r["state"] for i, r in v["replicas"].items()} for v in model["versions"]}


async def _serving_v1(
    stack: Stack, tmp_path: Path, answers: Answers, replicas: int = 1
) -> tuple[asyncio.Event, asyncio.Task[None]]:
    await stack.apply("m", model_source(tmp_path, "v1"), replicas)
    first = await stack.wait_for("m", lambda m: m["state"] == "ModelAvailable", "version 1 Available")
    assert versions_of(first) == {1: {str(i): "Available" for i in range(replicas)}}
    stop = asyncio.Event()
    load = asyncio.create_task(stack.steady_load("m", answers, stop))
    await wait_until(answers.enough(20), attempts=1000, interval=0.01)
    return stop, load


async def test_a_rollout_under_load_fails_no_request(stack: Stack, tmp_path: Path) -> None:
    answers = Answers()
    stop, load = await _serving_v1(stack, tmp_path, answers)
    try:
        change = await stack.apply("m", model_source(tmp_path, "v2"))
        assert change["change"] == "new_version"
        # Version 2 loads on replica 1 (slowly); version 1 keeps serving on replica 0 meanwhile.
        await stack.wait_for("m", lambda m: versions_of(m).get(2) == {"1": "Loading"}, "version 2 loading")
        during_load = len(answers.seen)
        await wait_until(answers.enough(during_load + 10), attempts=1000, interval=0.01)
        assert {backend for _, backend, _ in answers.seen[during_load:]} <= {"sim-0"}
        # Version 2 Available; version 1 unloads (after the grace) and is pruned.
        rolled = await stack.wait_for("m", lambda m: list(versions_of(m)) == [2], "version 1 retired")
        assert rolled["state"] == "ModelAvailable"
        assert versions_of(rolled) == {2: {"1": "Available"}}
        after = len(answers.seen)
        await wait_until(answers.enough(after + 20), attempts=1000, interval=0.01)
    finally:
        stop.set()
        await load

    assert answers.failed == [], answers.failed[:5]
    assert {backend for _, backend, _ in answers.seen[after:]} == {"sim-1"}  # only version 2 now
    # The split: while version 2 was routable and version 1 still the last Available, the feed
    # named both, 50/50 by routable replicas (compat §6.2); then version 2 alone.
    entries = [(e["versions"], [(p["name"], p["version"]) for p in e["endpoints"]]) for e in stack.feed]
    split = (
        [{"version": 1, "weight": 50}, {"version": 2, "weight": 50}],
        [("sim-0", 1), ("sim-1", 2)],
    )
    assert split in entries, entries
    assert entries[-1] == ([{"version": 2, "weight": 100}], [("sim-1", 2)])
    assert entries.index(split) < len(entries) - 1
    # The old version was unloaded from replica 0; the new one is loaded on replica 1.
    assert (await stack.repository(0))["loaded"] == {}
    assert (await stack.repository(1))["loaded"] == {"m": 1000}
    # The gateway follows: one version, its endpoint back in subset `default`, no rollout route.
    cluster = stack.gateway.app[GATEWAY].clusters["m"]
    assert [(e.name, e.subset) for e in cluster.endpoints] == [("sim-1", "default")]
    assert cluster.config.routes == []
    print(f"rollout: {len(answers.seen)} requests, {len(answers.failed)} failed")


async def test_a_new_version_that_fails_to_load_leaves_the_old_serving(stack: Stack, tmp_path: Path) -> None:
    answers = Answers()
    stop, load = await _serving_v1(stack, tmp_path, answers)
    try:
        await stack.apply("m", model_source(tmp_path, "broken", fail_load=True))
        failed = await stack.wait_for("m", lambda m: m["state"] == "ModelFailed", "version 2 ModelFailed")
        before = len(answers.seen)
        await wait_until(answers.enough(before + 20), attempts=1000, interval=0.01)
    finally:
        stop.set()
        await load

    assert answers.failed == [], answers.failed[:5]
    assert {backend for _, backend, _ in answers.seen} == {"sim-0"}
    assert failed["version"] == 2
    assert "simulated load failure" in failed["reason"], failed
    assert versions_of(failed) == {1: {"0": "Available"}, 2: {"1": "LoadFailed"}}
    assert (await stack.repository(0))["loaded"] == {"m": 1000}
    assert (await stack.repository(1))["loaded"] == {}
    print(f"failed rollout: {len(answers.seen)} requests, {len(answers.failed)} failed")


async def test_the_gateway_splits_traffic_while_both_versions_serve(stack: Stack, tmp_path: Path) -> None:
    """Two replicas, both serving version 1: version 2 replaces it on each (a server holds one
    version of a model). Replica 0 loads at once, replica 1 takes 0.5 s: meanwhile the gateway
    splits 50/50 between version 1 on replica 1 and version 2 on replica 0 (subsets v1 and v2)."""
    answers = Answers()
    stop, load = await _serving_v1(stack, tmp_path, answers, replicas=2)
    try:
        await stack.apply("m", model_source(tmp_path, "v2"), replicas=2)

        async def split_seen() -> bool:
            return {"v1", "v2"} <= {subset for _, _, subset in answers.seen}

        await wait_until(split_seen, attempts=1000, interval=0.01)
        rolled = await stack.wait_for("m", lambda m: list(versions_of(m)) == [2], "version 1 retired")
        assert versions_of(rolled) == {2: {"0": "Available", "1": "Available"}}
        after = len(answers.seen)
        await wait_until(answers.enough(after + 20), attempts=1000, interval=0.01)
    finally:
        stop.set()
        await load

    assert answers.failed == [], answers.failed[:5]
    during = [(backend, subset) for _, backend, subset in answers.seen if subset.startswith("v")]
    assert set(during) == {("sim-1", "v1"), ("sim-0", "v2")}
    assert {subset for _, _, subset in answers.seen[after:]} == {"*"}  # one version: no split
    assert {backend for _, backend, _ in answers.seen[after:]} == {"sim-0", "sim-1"}
    print(f"split rollout: {len(answers.seen)} requests, {len(during)} split, {len(answers.failed)} failed")


async def test_a_new_version_that_fails_where_it_replaces_the_old_leaves_the_old_serving(
    stack: Stack, tmp_path: Path
) -> None:
    """Both replicas serve version 1, so version 2 can only replace it in place; it fails to load
    on both. The servers keep serving version 1 (a failed reload keeps the old model, as MLServer
    does), so the agents keep it, with its files: no request fails and the model says why."""
    answers = Answers()
    stop, load = await _serving_v1(stack, tmp_path, answers, replicas=2)
    try:
        await stack.apply("m", model_source(tmp_path, "broken", fail_load=True), replicas=2)
        failed = await stack.wait_for(
            "m",
            lambda m: versions_of(m).get(2) == {"0": "LoadFailed", "1": "LoadFailed"},
            "version 2 LoadFailed on both replicas",
        )
        assert failed["state"] == "ModelFailed"
        before = len(answers.seen)
        await wait_until(answers.enough(before + 40), attempts=1000, interval=0.01)
    finally:
        stop.set()
        await load

    assert answers.failed == [], answers.failed[:5]
    assert "simulated load failure" in failed["reason"], failed
    assert versions_of(failed) == {
        1: {"0": "Available", "1": "Available"},
        2: {"0": "LoadFailed", "1": "LoadFailed"},
    }
    assert {backend for _, backend, _ in answers.seen[before:]} == {"sim-0", "sim-1"}
    for index, agent in enumerate(stack.agents):
        held = agent.state.get("m")
        assert held is not None and held.version == 1
        settings = json.loads(
            (stack.workers[index].config.repository / "m" / "model-settings.json").read_text()
        )
        assert "fail_load" not in settings["parameters"]["extra"]  # version 1's files are back
    print(f"failed in-place rollout: {len(answers.seen)} requests, {len(answers.failed)} failed")
