"""The scheduler in-process on port 0, driven over REST, the feed and a fake agent speaking gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest

from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from support import free_ports

AGENT_URL = "http://127.0.0.1:18080"
IRIS = {"storage_uri": "file:///models/iris", "memory": 100}


class FakeAgent:
    """Subscribes as one replica and answers every LOAD with LOADED and UNLOAD with UNLOADED."""

    def __init__(self, address: str, loaded: tuple[tuple[str, int], ...] = ()) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        self.loaded = loaded
        self.operations: list[tuple[str, str, int]] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        request = agent_pb2.SubscribeRequest(
            server_name="mlserver",
            replica_idx=0,
            shared=True,
            replica_config=agent_pb2.ReplicaConfig(inference_url=AGENT_URL, memory_bytes=1000),
            loaded_models=[agent_pb2.LoadedModel(name=n, version=v) for n, v in self.loaded],
            available_memory_bytes=1000,
        )
        self._call = self.stub.Subscribe(request)
        self._task = asyncio.create_task(self._answer())

    async def _answer(self) -> None:
        async for op in self._call:
            load = op.operation == agent_pb2.ModelOperation.LOAD_MODEL
            version = op.model_version
            self.operations.append(("load" if load else "unload", version.name, version.version))
            event = agent_pb2.ModelEvent.LOADED if load else agent_pb2.ModelEvent.UNLOADED
            await self.stub.AgentEvent(
                agent_pb2.ModelEvent(
                    server_name="mlserver",
                    replica_idx=0,
                    model_name=version.name,
                    model_version=version.version,
                    event=event,
                    available_memory_bytes=1000,
                )
            )

    async def stop(self) -> None:
        self._call.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._task
        await self.channel.close()


async def until(check: Any, what: str, *, attempts: int = 500) -> Any:
    """Poll `check()` (async) every 10 ms until it returns something truthy; bounded."""
    for _ in range(attempts):
        if result := await check():
            return result
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def next_line(feed: aiohttp.ClientResponse) -> dict[str, Any]:
    async with asyncio.timeout(5):
        line = await feed.content.readline()
    assert line, "the feed ended"
    parsed: dict[str, Any] = orjson.loads(line)
    return parsed


async def line_where(feed: aiohttp.ClientResponse, predicate: Any) -> dict[str, Any]:
    for _ in range(50):
        line = await next_line(feed)
        if predicate(line):
            return line
    raise AssertionError("no such feed line")


@pytest.fixture
async def scheduler(tmp_path: Path) -> AsyncIterator[Any]:
    started: list[RunningScheduler] = []

    async def start(**overrides: Any) -> RunningScheduler:
        settings = {
            "port": 0,
            "agent_port": 0,
            "db": str(tmp_path / "s.db"),
            "retry_interval": 60,
            **overrides,
        }
        running = await start_scheduler(SchedulerConfig(**settings))
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _model(http: aiohttp.ClientSession, sched: RunningScheduler, name: str) -> dict[str, Any]:
    async with http.get(f"{sched.url}/v1/models/{name}") as response:
        body: dict[str, Any] = await response.json()
        return body


async def test_apply_place_serve_and_lose_the_agent(scheduler: Any, http: aiohttp.ClientSession) -> None:
    sched = await scheduler()
    agent = FakeAgent(sched.agent_address)
    await agent.start()
    async with http.get(f"{sched.url}/v1/feed") as feed:
        assert feed.headers["Content-Type"] == "application/x-ndjson"
        assert await next_line(feed) == {"type": "snapshot", "models": []}
        async with http.put(f"{sched.url}/v1/models/iris", json=IRIS) as response:
            assert response.status == 200
            body = await response.json()
        assert body["change"] == "created" and body["name"] == "iris" and body["version"] == 1
        assert body["spec"]["storage_uri"] == "file:///models/iris"
        line = await line_where(feed, lambda line: line.get("state") == "ModelAvailable")
        assert line == {
            "type": "model",
            "name": "iris",
            "version": 1,
            "state": "ModelAvailable",
            "reason": "",
            "available_replicas": 1,
            "unavailable_replicas": 0,
            "endpoints": [{"name": "mlserver-0", "url": AGENT_URL, "version": 1}],
            "versions": [{"version": 1, "weight": 100}],
        }
        model = await _model(http, sched, "iris")
        assert model["versions"][0]["replicas"]["0"]["state"] == "Available"
        assert agent.operations == [("load", "iris", 1)]
        async with http.get(f"{sched.url}/v1/servers") as response:
            (server,) = (await response.json())["servers"]
        assert server["name"] == "mlserver" and server["replicas"][0]["loaded_models"] == ["iris"]
        assert server["replicas"][0]["connected"] is True

        await agent.stop()  # the agent is gone: the feed drops its endpoint at once
        line = await line_where(feed, lambda line: line.get("type") == "model")
        assert line["endpoints"] == [] and line["state"] == "ScheduleFailed"
    async with http.get(f"{sched.url}/v1/servers") as response:
        assert (await response.json())["servers"] == []


async def test_restart_restores_state_and_reloads_nothing(
    scheduler: Any, http: aiohttp.ClientSession
) -> None:
    first = await scheduler()
    agent = FakeAgent(first.agent_address)
    await agent.start()
    async with http.put(f"{first.url}/v1/models/iris", data="memory: 100\nstorage_uri: file:///m\n") as r:
        assert r.status == 200

    async def available() -> bool:
        return (await _model(http, first, "iris"))["state"] == "ModelAvailable"

    await until(available, "iris available")
    await first.stop()
    await agent.stop()

    second = await scheduler(resync_timeout=30)
    async with http.get(f"{second.url}/readyz") as response:
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "scheduler_unavailable"
    async with http.get(f"{second.url}/v1/feed") as feed:
        snapshot = await next_line(feed)
        assert snapshot["models"][0]["endpoints"] == [{"name": "mlserver-0", "url": AGENT_URL, "version": 1}]
    again = FakeAgent(second.agent_address, loaded=(("iris", 1),))
    await again.start()

    async def ready() -> bool:
        async with http.get(f"{second.url}/readyz") as response:
            return response.status == 200

    await until(ready, "the resync to end")
    assert (await _model(http, second, "iris"))["state"] == "ModelAvailable"
    assert again.operations == []  # nothing loaded again
    await again.stop()


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [
        ({"storage_uri": "x", "replicas": -1}, 400, "invalid_model_spec", "replicas"),
        ({"name": "other", "storage_uri": "x"}, 400, "invalid_model_spec", "name"),
        (
            {
                "apiVersion": "mlops.seldon.io/v1alpha1",
                "kind": "Model",
                "spec": {"storageUri": "x", "minReplicas": "a"},
            },
            400,
            "invalid_model_spec",
            "spec.minReplicas",
        ),
        ("{not json", 400, "invalid_request_error", "JSON or YAML"),
        (("{not json", "application/json"), 400, "invalid_json", "not valid JSON: "),
        ("x" * (1024 * 1024 + 1), 413, "request_too_large", "larger"),
    ],
)
async def test_bad_puts(
    scheduler: Any, http: aiohttp.ClientSession, body: Any, status: int, code: str, says: str
) -> None:
    sched = await scheduler(db=":memory:")
    if isinstance(body, tuple):
        kwargs: dict[str, Any] = {"data": body[0], "headers": {"Content-Type": body[1]}}
    else:
        kwargs = {"data": body} if isinstance(body, str) else {"json": body}
    async with http.put(f"{sched.url}/v1/models/iris", **kwargs) as response:
        assert response.status == status
        error = (await response.json())["error"]
    assert error["code"] == code and says in error["message"]


async def test_seldon_model_resource_and_unknown_models(scheduler: Any, http: aiohttp.ClientSession) -> None:
    sched = await scheduler(db=":memory:")
    resource = (
        "apiVersion: mlops.seldon.io/v1alpha1\nkind: Model\nmetadata: {name: iris}\nspec:\n  storageUri: s\n"
    )
    async with http.put(f"{sched.url}/v1/models/iris", data=resource) as response:
        body = await response.json()
    assert response.status == 200 and body["state"] == "ScheduleFailed"
    for method in ("GET", "DELETE"):
        async with http.request(method, f"{sched.url}/v1/models/nope") as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "model_not_found"
    async with http.delete(f"{sched.url}/v1/models/iris") as response:
        assert (await response.json())["state"] == "ModelTerminated"
    async with http.get(f"{sched.url}/v1/models") as response:
        assert (await response.json()) == {"models": []}


class ReconnectingAgent:
    """An agent as the real one reconnects: a fresh channel per try, waits doubling from 0.1 s to at
    most 2 s between tries; it reports what it holds when it subscribes again."""

    def __init__(self, address: str, index: int) -> None:
        self.address, self.index = address, index
        self.held: set[tuple[str, int]] = set()
        self.loads: list[tuple[str, int, float]] = []  # (model, version, when)
        self.subscribed: list[float] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_reconnect_backoff_ms", 2000)]
            channel = grpc.aio.insecure_channel(self.address, options)
            try:
                await self._serve(agent_pb2_grpc.AgentServiceStub(channel))
                backoff = 0.1
            except grpc.aio.AioRpcError:
                pass
            finally:
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _serve(self, stub: Any) -> None:
        request = agent_pb2.SubscribeRequest(
            server_name="mlserver",
            replica_idx=self.index,
            shared=True,
            replica_config=agent_pb2.ReplicaConfig(
                inference_url=f"{AGENT_URL}{self.index}", memory_bytes=1000
            ),
            loaded_models=[agent_pb2.LoadedModel(name=n, version=v) for n, v in sorted(self.held)],
            available_memory_bytes=1000,
        )
        call = stub.Subscribe(request, wait_for_ready=False)
        self.subscribed.append(time.monotonic())
        async for op in call:
            name, version = op.model_version.name, op.model_version.version
            if op.operation == agent_pb2.ModelOperation.LOAD_MODEL:
                self.held.add((name, version))
                self.loads.append((name, version, time.monotonic()))
                kind = agent_pb2.ModelEvent.LOADED
            else:
                self.held.discard((name, version))
                kind = agent_pb2.ModelEvent.UNLOADED
            event = agent_pb2.ModelEvent(
                server_name="mlserver",
                replica_idx=self.index,
                model_name=name,
                model_version=version,
                event=kind,
                available_memory_bytes=1000,
            )
            await stub.AgentEvent(event, timeout=5)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_a_restart_waits_for_agents_reconnecting_with_backoff_and_ends_once_all_are_back(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The probe's restart: agents came back 18-37 s later, after the old 15 s resync timeout, and
    their models flapped to ScheduleFailed. Now the resync waits 60 s by default and ends as soon as
    every known replica has re-subscribed; nothing is placed or loaded again meanwhile."""
    assert SchedulerConfig().resync_timeout == 60.0
    rest_port, agent_port = free_ports(2)
    settings = {
        "port": rest_port,
        "agent_port": agent_port,
        "db": str(tmp_path / "s.db"),
        "retry_interval": 60,
    }
    first = await start_scheduler(SchedulerConfig(**settings))
    agents = [ReconnectingAgent(f"127.0.0.1:{agent_port}", index) for index in (0, 1)]
    second: RunningScheduler | None = None
    try:
        async with http.put(f"{first.url}/v1/models/iris", json={**IRIS, "replicas": 2}) as response:
            assert response.status == 200

        async def available(sched: RunningScheduler) -> bool:
            return (await _model(http, sched, "iris"))["state"] == "ModelAvailable"

        await until(lambda: available(first), "iris available on both replicas")
        await first.stop()
        await asyncio.sleep(3.5)  # the agents try again and again, backing off to 2 s apart
        second = await start_scheduler(SchedulerConfig(**settings))  # the default resync timeout
        restarted = time.monotonic()
        states: list[str] = []
        async with http.get(f"{second.url}/v1/feed") as feed:
            snapshot = await next_line(feed)
            states += [m["state"] for m in snapshot["models"]]

            async def ready() -> bool:
                async with http.get(f"{second.url}/readyz") as response:
                    return response.status == 200

            await until(ready, "every replica back", attempts=1000)  # within 10 s, not 60
            waited = time.monotonic() - restarted
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    while True:
                        line = await next_line(feed)
                        if line.get("type") == "model":
                            states.append(line["state"])
        assert waited < 10.0
        assert all(len(agent.subscribed) >= 2 for agent in agents)
        assert "ScheduleFailed" not in states and states[0] == "ModelAvailable", states
        assert await available(second)
        assert all(when < restarted for agent in agents for _, _, when in agent.loads)  # nothing loaded again
    finally:
        for agent in agents:
            await agent.stop()
        if second is not None:
            await second.stop()


class FreezingProxy:
    """A TCP proxy to `port` that can stop passing bytes without closing anything: to the scheduler,
    an agent whose host vanished (a half-open connection)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.frozen = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                if self.frozen.is_set():
                    await asyncio.Future()  # hold the bytes, and the connection, for ever
                sink.write(data)
                await sink.drain()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()


async def test_a_vanished_agent_frees_its_slot_for_the_one_replacing_it(
    scheduler: Any, http: aiohttp.ClientSession
) -> None:
    """A second agent cannot take a connected replica's slot; when the connected one's host vanishes
    without closing its connection, the keepalive ends its stream and the replacement gets in."""
    sched = await scheduler(db=":memory:", agent_keepalive=1.0)
    proxy = FreezingProxy(sched.agent_port)
    port = await proxy.start()
    gone = FakeAgent(f"127.0.0.1:{port}")
    replacement = FakeAgent(sched.agent_address)
    try:
        await gone.start()

        async def connected() -> bool:
            server = sched.state.servers.get("mlserver")
            return server is not None and server.replicas[0].connected

        await until(connected, "the first agent subscribed")
        proxy.frozen.set()
        await replacement.start()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            assert replacement._task is not None
            await replacement._task
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS

        async def taken_over() -> bool:
            replacement._task = None
            await replacement.start()
            assert replacement._task is not None
            try:
                await asyncio.wait_for(asyncio.shield(replacement._task), 0.2)
            except TimeoutError:  # its stream stays open: it holds the slot
                return sched.state.servers["mlserver"].replicas[0].connected
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.ALREADY_EXISTS
            return False

        await until(taken_over, "the slot freed by the keepalive", attempts=1000)
    finally:
        await replacement.stop()
        await gone.stop()
        await proxy.stop()
