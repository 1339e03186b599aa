"""Placement end to end on real MLServer: a scheduler, two MLServer replicas of server `mlserver`, each
with an agent of a different memory budget, and a gateway following the scheduler's feed.

Replica 0 offers 5 MB, replica 1 offers 10 MB (the agents' `--memory`; the models' `memory` is what
placement reserves). Each test starts its own scheduler (SQLite file), agents and gateway over the
two MLServer processes, which the module starts once (an agent unloads whatever a previous test
left on its server when it starts, as Seldon's does). MLServer's venv is the one
test_graph_mlserver.py builds under .cache/.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_graph_mlserver import SETOSA, TRAIN, VIRGINICA, _mlserver_venv, _wait_ready, infer_body

from modelyard.agent import Agent, AgentConfig, start_agent
from modelyard.config import validate_config
from modelyard.gateway import GATEWAY, RunningGateway, start_gateway
from modelyard.placement import NO_MATCHING_SERVERS, NOT_ENOUGH_REPLICAS
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from support import free_ports, metric_value, wait_until

MB = 1_000_000
MEMORY = (5 * MB, 10 * MB)  # replica 0, replica 1


@dataclass
class MLServer:
    """One MLServer process over its own (initially empty) model repository."""

    root: Path
    venv: Path
    url: str = ""
    repository: Path = field(init=False)
    log: Path = field(init=False)
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.repository = self.root / "repository"
        self.repository.mkdir(parents=True)
        self.log = self.root / "mlserver.log"

    def start(self) -> None:
        http_port, grpc_port, metrics_port = free_ports(3)
        # `mlserver start DIR` makes DIR the repository root: the server's settings live there.
        settings = {
            "host": "127.0.0.1",
            "http_port": http_port,
            "grpc_port": grpc_port,
            "metrics_port": metrics_port,
            "parallel_workers": 0,
            "load_models_at_startup": False,
        }
        (self.repository / "settings.json").write_text(json.dumps(settings))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(self.venv / "bin" / "mlserver"), "start", str(self.repository)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.url = f"http://127.0.0.1:{http_port}"
        _wait_ready(self.url, self.process, self.log)

    def ensure_running(self) -> None:
        if self.process is None or self.process.poll() is not None:
            self.start()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def loads_of(self, model: str) -> int:
        """How many times this server has loaded `model` (MLServer logs each successful load)."""
        return self.log.read_text(errors="replace").count(f"Loaded model '{model}' successfully")


@pytest.fixture(scope="module")
def iris_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("iris-source") / "iris"
    source.mkdir()
    venv = _mlserver_venv()
    subprocess.run(
        [str(venv / "bin" / "python"), "-c", TRAIN, str(source / "model.joblib")], check=True, timeout=300
    )
    (source / "model-settings.json").write_text(
        json.dumps(
            {
                "name": "iris",  # the agent renames it to each model's own name
                "implementation": "mlserver_sklearn.SKLearnModel",
                "parameters": {"uri": "./model.joblib"},
            }
        )
    )
    return source


@pytest.fixture(scope="module")
def mlservers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[MLServer]]:
    venv = _mlserver_venv()
    servers = [MLServer(tmp_path_factory.mktemp(f"mlserver-{i}"), venv) for i in range(2)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


@dataclass
class Stack:
    scheduler: RunningScheduler
    config: SchedulerConfig
    agents: list[Agent | None]
    gateway: RunningGateway
    servers: list[MLServer]
    http: aiohttp.ClientSession
    source: Path

    async def apply(self, name: str, **spec: Any) -> dict[str, Any]:
        body = {"name": name, "storage_uri": str(self.source), "requirements": ["sklearn"], **spec}
        async with self.http.put(f"{self.scheduler.url}/v1/models/{name}", json=body) as response:
            assert response.status == 200, await response.text()
            return dict(await response.json())

    async def model(self, name: str) -> dict[str, Any]:
        async with self.http.get(f"{self.scheduler.url}/v1/models/{name}") as response:
            assert response.status == 200, await response.text()
            return dict(await response.json())

    async def wait_state(self, name: str, state: str, within: float = 90) -> dict[str, Any]:
        return await self.wait_for(name, lambda model: model["state"] == state, state, within)

    async def wait_for(
        self, name: str, holds: Callable[[dict[str, Any]], bool], what: str, within: float = 90
    ) -> dict[str, Any]:
        """The model's status once `holds` is true of it (`what` names that in the failure)."""
        seen: dict[str, Any] = {}

        async def reached() -> bool:
            seen.update(await self.model(name))
            return bool(holds(seen))

        try:
            await wait_until(reached, attempts=int(within / 0.1), interval=0.1)
        except AssertionError:
            raise AssertionError(f"{name} never reached {what}; last: {json.dumps(seen)}") from None
        return seen

    async def infer(self, name: str) -> tuple[int, dict[str, str], Any]:
        url = f"{self.gateway.url}/v2/models/{name}/infer"
        async with self.http.post(url, json=infer_body(SETOSA, VIRGINICA)) as response:
            body = await response.json(content_type=None)
            return response.status, dict(response.headers), body

    async def start_agent(self, index: int, overcommit_percent: int = 0) -> None:
        self.servers[index].ensure_running()
        self.agents[index] = await start_agent(
            AgentConfig(
                scheduler=self.scheduler.agent_address,
                server_name="mlserver",
                replica_idx=index,
                inference_url=self.servers[index].url,
                memory_bytes=MEMORY[index],
                capabilities=("mlserver", "sklearn"),  # type: ignore[arg-type]
                repository=self.servers[index].repository,
                unload_grace=0,
                load_attempts=2,
                load_backoff=0.05,
                overcommit_percent=overcommit_percent,
                fetch_roots=(self.source.parent,),  # the iris source, beside the repository
            )
        )

    def connected(self, count: int) -> Any:
        async def replicas_connected() -> bool:
            async with self.http.get(f"{self.scheduler.url}/v1/servers") as response:
                servers = (await response.json())["servers"]
            return sum(1 for s in servers for r in s["replicas"] if r["connected"]) == count

        return replicas_connected

    async def stop_agent(self, index: int) -> None:
        agent, self.agents[index] = self.agents[index], None
        if agent is not None:
            await agent.stop()


def replicas_of(model: dict[str, Any]) -> dict[str, str]:
    """replica index -> state, for the model's latest version."""
    latest = model["versions"][-1]
    return {index: replica["state"] for index, replica in latest["replicas"].items()}


@pytest.fixture
async def stack(
    mlservers: list[MLServer], iris_source: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> AsyncIterator[Stack]:
    rest_port, agent_port = free_ports(2)
    config = SchedulerConfig(
        port=rest_port, agent_port=agent_port, db=str(tmp_path / "scheduler.db"), retry_interval=1.0
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
    stack = Stack(scheduler, config, [None, None], gateway, mlservers, http, iris_source)
    try:
        for index in range(2):
            await stack.start_agent(index)
        await wait_until(stack.connected(2), attempts=300, interval=0.1)
        yield stack
    finally:
        for index in range(2):
            await stack.stop_agent(index)
        await gateway.stop()
        await stack.scheduler.stop()


async def test_placement_by_memory_and_infer_through_the_gateway(stack: Stack) -> None:
    # 7 MB fits only replica 1 (10 MB); 1 MB x 2 replicas takes both.
    await stack.apply("iris-big", memory=7 * MB)
    await stack.apply("iris-pair", memory=1 * MB, replicas=2)
    big = await stack.wait_state("iris-big", "ModelAvailable")
    pair = await stack.wait_state("iris-pair", "ModelAvailable")
    assert replicas_of(big) == {"1": "Available"}
    assert replicas_of(pair) == {"0": "Available", "1": "Available"}
    assert (big["server"], big["available_replicas"]) == ("mlserver", 1)

    status, headers, body = await stack.infer("iris-big")
    assert status == 200, body
    assert body["model_name"] == "iris-big"
    assert body["outputs"][0]["data"] == [0, 2]  # setosa, virginica: the real scikit-learn model
    assert headers["X-Modelyard-Backend"] == "mlserver-1"
    # least_pending breaks ties at random: one at a time, requests reach both replicas soon
    # (6 requests all to one replica happened 1 run in about 30; 40 leave 1 in 10^11).
    backends = set()
    for _ in range(40):
        status, headers, body = await stack.infer("iris-pair")
        assert status == 200, body
        backends.add(headers["X-Modelyard-Backend"])
        if len(backends) == 2:
            break
    assert backends == {"mlserver-0", "mlserver-1"}

    async with stack.http.get(f"{stack.scheduler.url}/v1/servers") as response:
        (server,) = (await response.json())["servers"]
    free = {r["index"]: r["available_memory"] for r in server["replicas"]}
    assert free == {0: MEMORY[0] - 1 * MB, 1: MEMORY[1] - 8 * MB}  # what each agent reported


async def test_what_cannot_be_placed_says_why(stack: Stack) -> None:
    await stack.apply("needs-gpu", memory=MB, requirements=["sklearn", "gpu"])
    failed = await stack.wait_state("needs-gpu", "ScheduleFailed")
    assert failed["reason"] == NO_MATCHING_SERVERS
    status, headers, body = await stack.infer("needs-gpu")
    assert status == 503 and "Retry-After" in headers
    assert "ScheduleFailed" in body["error"] and NO_MATCHING_SERVERS in body["error"]

    # The server has two replicas: three cannot be placed, and a version is never split.
    await stack.apply("three", memory=MB, replicas=3)
    three = await stack.wait_state("three", "ScheduleFailed")
    assert three["reason"] == NOT_ENOUGH_REPLICAS
    assert replicas_of(three) == {}

    # With min_replicas it is placed on the two there are, and serves.
    await stack.apply("partial", memory=MB, replicas=3, min_replicas=1)
    await stack.wait_state("partial", "ModelAvailable")
    # (available once min_replicas are: the second replica may still be loading at that moment)
    partial = await stack.wait_for("partial", lambda model: model["available_replicas"] == 2, "2 replicas")
    assert partial["state"] == "ModelAvailable"
    assert replicas_of(partial) == {"0": "Available", "1": "Available"}
    assert (partial["available_replicas"], partial["spec"]["replicas"]) == (2, 3)
    status, _, body = await stack.infer("partial")
    assert status == 200, body


async def test_an_agent_killed_under_load_its_models_come_back_on_the_other(stack: Stack) -> None:
    await stack.apply("iris-pair", memory=MB, replicas=2, min_replicas=1)
    await stack.apply("iris-one", memory=MB)  # one replica: the one with more free memory, 1
    await stack.wait_state("iris-pair", "ModelAvailable")
    one = await stack.wait_state("iris-one", "ModelAvailable")
    assert replicas_of(one) == {"1": "Available"}

    answers: dict[str, list[tuple[int, bool, str]]] = {"iris-pair": [], "iris-one": []}
    stop = asyncio.Event()

    async def load(name: str) -> None:
        deadline = time.monotonic() + 90
        while not stop.is_set() and time.monotonic() < deadline:
            status, headers, body = await stack.infer(name)
            error = body.get("error", "") if isinstance(body, dict) else ""
            answers[name].append((status, "Retry-After" in headers, error))

    loaders = [asyncio.create_task(load(name)) for name in answers]
    try:
        await wait_until(_answered(answers, 20), attempts=3000)
        # The replica dies: its agent, then its MLServer. The agent's stream ending takes the replica
        # out of the feed at once; the server is killed once the gateway has stopped sending to it
        # and its last answers are in. (Killed together, a response cut mid-body would be a 502: an
        # answer has begun, so it is not retried, as in Envoy.)
        await stack.stop_agent(1)
        gone = stack.servers[1].url

        async def stopped_routing_there() -> bool:
            gateway = stack.gateway.app[GATEWAY]
            routed = {e.url for c in gateway.clusters.values() for e in c.endpoints}
            load = gateway.loads.get(gone)
            return gone not in routed and (load is None or load.in_flight == 0)

        await wait_until(stopped_routing_there, attempts=1000)
        stack.servers[1].kill()
        moved = await stack.wait_state("iris-one", "ModelAvailable")
        assert moved["server"] == "mlserver"
        assert replicas_of(moved) == {"0": "Available"}
        count = len(answers["iris-one"])
        await wait_until(_answered(answers, count + 20), attempts=3000)
    finally:
        stop.set()
        await asyncio.gather(*loaders)

    # The model on both replicas kept answering; it serves on one now, and cannot get its second.
    assert {status for status, _, _ in answers["iris-pair"]} == {200}, answers["iris-pair"][-5:]
    pair = await stack.model("iris-pair")
    assert replicas_of(pair) == {"0": "Available"}
    # The moved model answered while it moved, or said when to come back; then it answered again.
    for status, retry_after, error in answers["iris-one"]:
        assert status == 200 or (status == 503 and retry_after and "iris-one" in error), (status, error)
    assert answers["iris-one"][-1][0] == 200
    stack.servers[1].ensure_running()


async def test_a_restarted_scheduler_restores_its_state_and_reloads_nothing(stack: Stack) -> None:
    await stack.apply("iris-kept", memory=MB, replicas=2)
    await stack.wait_state("iris-kept", "ModelAvailable")
    loads = [server.loads_of("iris-kept") for server in stack.servers]
    assert loads == [1, 1]

    await stack.scheduler.stop()
    status, _, body = await stack.infer("iris-kept")
    assert status == 200, body  # the gateway routes with what it last knew
    stack.scheduler = await start_scheduler(stack.config)

    async def resynced() -> bool:
        async with stack.http.get(f"{stack.scheduler.url}/readyz") as response:
            return response.status == 200

    await wait_until(resynced, attempts=300, interval=0.1)  # both agents are back
    kept = await stack.wait_state("iris-kept", "ModelAvailable")
    assert replicas_of(kept) == {"0": "Available", "1": "Available"}
    assert kept["version"] == 1
    assert [server.loads_of("iris-kept") for server in stack.servers] == loads  # nothing reloaded
    status, _, body = await stack.infer("iris-kept")
    assert status == 200, body


async def test_delete_unloads_from_the_servers(stack: Stack) -> None:
    await stack.apply("iris-gone", memory=MB, replicas=2)
    await stack.wait_state("iris-gone", "ModelAvailable")
    async with stack.http.delete(f"{stack.scheduler.url}/v1/models/iris-gone") as response:
        assert response.status == 200

    async def forgotten() -> bool:
        async with stack.http.get(f"{stack.scheduler.url}/v1/models/iris-gone") as response:
            return response.status == 404

    await wait_until(forgotten, attempts=600, interval=0.1)
    for server in stack.servers:
        async with stack.http.get(f"{server.url}/v2/models/iris-gone/ready") as response:
            assert response.status in (400, 404), await response.text()
        assert not (server.repository / "iris-gone").exists()

    async def gateway_forgot() -> bool:
        return (await stack.infer("iris-gone"))[0] == 404

    await wait_until(gateway_forgot, attempts=300)


def _answered(answers: dict[str, list[tuple[int, bool, str]]], count: int) -> Any:
    async def enough() -> bool:
        return all(len(seen) >= count for seen in answers.values())

    return enough


async def test_two_models_that_do_not_fit_together_take_turns_and_every_request_is_answered(
    stack: Stack,
) -> None:
    """Issue 9 item 7: replica 0 alone (5 MB, 100% overcommit) holds two 4 MB models. Loading the
    second evicts the first from MLServer; requests alternating between them through the gateway
    are all answered, each reloading its model (the agent evicts the other one first)."""
    await stack.stop_agent(1)
    await stack.stop_agent(0)
    await stack.start_agent(0, overcommit_percent=100)
    await stack.apply("iris-a", memory=4 * MB)
    await stack.wait_state("iris-a", "ModelAvailable")
    await stack.apply("iris-b", memory=4 * MB)
    placed = await stack.wait_state("iris-b", "ModelAvailable")
    assert replicas_of(placed) == {"0": "Available"}
    assert replicas_of(await stack.model("iris-a")) == {"0": "Available"}  # still registered there
    server = stack.servers[0]
    loads_before = server.loads_of("iris-a")
    answers = []
    for name in ["iris-a", "iris-b"] * 3:
        status, headers, body = await stack.infer(name)
        answers.append((status, headers.get("X-Modelyard-Backend"), body.get("model_name")))
    assert answers == [(200, "mlserver-0", name) for name in ["iris-a", "iris-b"] * 3], answers
    # Each request found its model evicted by the one before and had it reloaded.
    assert server.loads_of("iris-a") == loads_before + 3
    agent = stack.agents[0]
    assert agent is not None
    assert await metric_value(stack.http, agent.url, "modelyard_evictions_total", model="iris-a") >= 3
