"""The agent in-process between a fake scheduler (an AgentService servicer in this file) and a real
sim-worker in repository mode: subscribe, load, unload, failures, re-sync, artefact fetches."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import grpc
from aiohttp import web

from fake_agent_scheduler import OIP_BODY, Event, FakeScheduler, model_source
from modelyard.agent import Agent, AgentConfig
from modelyard.rpc.agent_v1 import agent_pb2, agent_pb2_grpc
from support import wait_until


async def _infer_status(http, worker, name: str) -> int:
    async with http.post(f"{worker.url}/v2/models/{name}/infer", json=OIP_BODY) as response:
        return response.status


async def test_subscribe_describes_the_replica_and_holds_nothing(setup):
    fake, agent, worker = await setup()
    request = fake.subscribes[0]
    assert (request.server_name, request.replica_idx, request.shared) == ("sim", 3, True)
    config = request.replica_config
    # The gateway is sent to the agent's data plane, which forwards to the server.
    assert config.inference_url == agent.url != worker.url
    assert (config.memory_bytes, list(config.capabilities), config.over_commit_percentage) == (
        1000,
        ["sim", "sklearn"],
        10,
    )
    assert list(request.loaded_models) == []
    assert request.available_memory_bytes == 1100  # overcommit included


async def test_load_serves_then_unload_removes_it(setup, http, tmp_path):
    fake, agent, worker = await setup()
    src = model_source(tmp_path, memory_bytes=300)
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", storage_uri=str(src), memory_bytes=300)
    loaded = await fake.event("iris", Event.LOADED)
    assert (loaded.server_name, loaded.replica_idx) == ("sim", 3)
    assert loaded.available_memory_bytes == 800
    assert loaded.runtime_info.instance_count == 2  # parallel_workers in model-settings.json
    assert await _infer_status(http, worker, "iris") == 200
    async with http.get(worker.url + "/sim/repository") as response:
        assert (await response.json())["loaded"] == {"iris": 300}
    repo_dir = agent.config.repository / "iris"
    assert json.loads((repo_dir / "model-settings.json").read_text())["name"] == "iris"

    fake.send(agent_pb2.ModelOperation.UNLOAD_MODEL, "iris")
    unloaded = await fake.event("iris", Event.UNLOADED)
    assert unloaded.available_memory_bytes == 1100
    assert await _infer_status(http, worker, "iris") == 404
    assert not repo_dir.exists()  # the artefact is deleted


async def test_a_failing_load_is_retried_then_reported_with_the_servers_text(setup, http, tmp_path):
    fake, agent, _worker = await setup()
    src = model_source(tmp_path, "broken", fail_load=True)
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "broken", storage_uri=str(src), memory_bytes=10)
    failed = await fake.event("broken", Event.LOAD_FAILED)
    assert "after 3 attempt(s)" in failed.message
    assert "simulated load failure" in failed.message
    assert failed.available_memory_bytes == 1100
    assert not (agent.config.repository / "broken").exists()
    assert agent.state.get("broken") is None


async def test_a_model_larger_than_the_replica_fails_at_once(setup, tmp_path):
    fake, _agent, _worker = await setup()
    fake.send(
        agent_pb2.ModelOperation.LOAD_MODEL,
        "huge",
        storage_uri=str(model_source(tmp_path, "huge")),
        memory_bytes=5000,
    )
    failed = await fake.event("huge", Event.LOAD_FAILED)
    assert "5000" in failed.message and "1000" in failed.message


async def test_unloading_an_unknown_model_answers_unloaded(setup):
    fake, _agent, _worker = await setup()
    fake.send(agent_pb2.ModelOperation.UNLOAD_MODEL, "never-loaded", version=7)
    await fake.event("never-loaded", Event.UNLOADED, version=7)


async def test_a_dropped_stream_is_resubscribed_with_the_models_held(setup, tmp_path):
    fake, _agent, _worker = await setup()
    fake.send(
        agent_pb2.ModelOperation.LOAD_MODEL, "iris", storage_uri=str(model_source(tmp_path)), memory_bytes=300
    )
    await fake.event("iris", Event.LOADED)
    fake.drop()

    async def resubscribed() -> bool:
        return len(fake.subscribes) >= 2

    await wait_until(resubscribed, attempts=1000)
    again = fake.subscribes[1]
    assert [(m.name, m.version, m.runtime_info.instance_count) for m in again.loaded_models] == [
        ("iris", 1, 2)
    ]
    assert again.available_memory_bytes == 800
    # and the new stream works
    fake.send(agent_pb2.ModelOperation.UNLOAD_MODEL, "iris")
    await fake.event("iris", Event.UNLOADED)


async def test_the_agent_outlives_a_scheduler_restart(sim_workers, tmp_path):
    """The scheduler goes away (port closed) and comes back on the same port: the agent resubscribes."""
    from support import free_ports

    (port,) = free_ports(1)
    target = f"127.0.0.1:{port}"

    async def serve() -> tuple[FakeScheduler, grpc.aio.Server]:
        fake = FakeScheduler()
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(fake, server)
        server.add_insecure_port(target)
        await server.start()
        return fake, server

    (worker,) = await sim_workers(1, repository_api=True)
    first, server = await serve()
    config = AgentConfig(
        scheduler=target,
        server_name="sim",
        inference_url=worker.url,
        unload_grace=0,
        reconnect_backoff=0.05,
        reconnect_backoff_max=0.2,
        connect_timeout=0.5,
    )
    async with Agent(config) as agent:
        await wait_until(lambda: _true(len(first.subscribes) == 1), attempts=1000)
        first.send(agent_pb2.ModelOperation.LOAD_MODEL, "llm", memory_bytes=100)
        await first.event("llm", Event.LOADED)
        await server.stop(0)
        second, server = await serve()
        try:
            await wait_until(lambda: _true(len(second.subscribes) == 1), attempts=1000)
            assert [m.name for m in second.subscribes[0].loaded_models] == ["llm"]
            assert agent.subscriptions >= 2
        finally:
            await server.stop(0)


async def _true(value: bool) -> bool:
    return value


async def test_storage_uri_over_http_is_downloaded_and_unpacked(setup, http, tmp_path):
    src = model_source(tmp_path, memory_bytes=100)
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w:gz") as tar:
        tar.add(src, arcname="iris")
    files = web.Application()

    async def tarball(request: web.Request) -> web.Response:
        return web.Response(body=payload.getvalue())

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/models/iris.tar.gz")

    files.router.add_get("/models/iris.tar.gz", tarball)
    files.router.add_get("/latest/iris.tar.gz", moved)
    runner = web.AppRunner(files)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        fake, agent, worker = await setup(fetch_networks=("127.0.0.0/8",))  # the files are on loopback
        fake.send(
            agent_pb2.ModelOperation.LOAD_MODEL,
            "iris",
            storage_uri=f"http://{host}:{port}/latest/iris.tar.gz",
            memory_bytes=100,
        )
        await fake.event("iris", Event.LOADED)
        assert sorted(p.name for p in (agent.config.repository / "iris").iterdir()) == [
            ".modelyard-agent",
            "model-settings.json",
            "weights.bin",
        ]
        assert await _infer_status(http, worker, "iris") == 200
        fake.send(
            agent_pb2.ModelOperation.LOAD_MODEL, "missing", storage_uri=f"http://{host}:{port}/nope.tar.gz"
        )
        failed = await fake.event("missing", Event.LOAD_FAILED)
        assert "404" in failed.message
    finally:
        await runner.cleanup()


async def test_a_new_version_replaces_the_old_and_unloading_the_old_leaves_it(setup, http, tmp_path):
    fake, agent, worker = await setup()
    src = model_source(tmp_path, memory_bytes=100)
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", version=1, storage_uri=str(src), memory_bytes=100)
    await fake.event("iris", Event.LOADED, version=1)
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", version=2, storage_uri=str(src), memory_bytes=200)
    v2 = await fake.event("iris", Event.LOADED, version=2)
    assert v2.available_memory_bytes == 900  # v1's memory no longer counts
    fake.send(agent_pb2.ModelOperation.UNLOAD_MODEL, "iris", version=1)
    await fake.event("iris", Event.UNLOADED, version=1)
    assert await _infer_status(http, worker, "iris") == 200  # v2 still served under its own name
    assert agent.state.holds("iris", 2)


async def test_a_load_received_during_an_unloads_grace_wins(setup, http, tmp_path):
    fake, agent, worker = await setup(unload_grace=0.3)
    src = model_source(tmp_path, memory_bytes=100)
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", storage_uri=str(src), memory_bytes=100)
    await fake.event("iris", Event.LOADED)
    fake.send(agent_pb2.ModelOperation.UNLOAD_MODEL, "iris")
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", storage_uri=str(src), memory_bytes=100)
    await fake.event("iris", Event.LOADED, count=2)

    async def settled() -> bool:
        return agent.pending_operations == 0

    await wait_until(settled, attempts=1000)
    assert not [e for e in fake.events if e.event == Event.UNLOADED]  # the older UNLOAD was dropped
    assert await _infer_status(http, worker, "iris") == 200


async def test_at_start_the_agent_unloads_what_it_did_not_load_unless_told_to_keep_it(
    scheduler, sim_workers, http
):
    _fake, target = scheduler
    (worker,) = await sim_workers(1, repository_api=True)
    for name in ("stray", "kept"):
        async with http.post(f"{worker.url}/v2/repository/models/{name}/load", json={}) as response:
            assert response.status == 200
    config = {"scheduler": target, "server_name": "sim", "inference_url": worker.url}
    async with Agent(AgentConfig(**config, keep_existing=True)):
        assert await _infer_status(http, worker, "stray") == 200
    async with Agent(AgentConfig(**config)):
        assert await _infer_status(http, worker, "stray") == 404
        assert await _infer_status(http, worker, "kept") == 404


def _users_model(repo: Path) -> Path:
    """A model the user put in the server's repository themselves."""
    user = repo / "iris"
    user.mkdir()
    (user / "model-settings.json").write_text(json.dumps({"name": "iris"}))
    (user / "weights.bin").write_bytes(b"the user's weights")
    return user


def _untouched(user: Path) -> None:
    assert sorted(p.name for p in user.iterdir()) == ["model-settings.json", "weights.bin"]
    assert (user / "weights.bin").read_bytes() == b"the user's weights"


async def test_a_load_over_the_users_own_model_directory_fails_and_leaves_it(setup, tmp_path):
    fake, agent, _worker = await setup()
    user = _users_model(agent.config.repository)
    # Before: the failed download's clean-up deleted <repository>/iris, the user's directory.
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", storage_uri="http://127.0.0.1:9/iris.tar.gz")
    failed = await fake.event("iris", Event.LOAD_FAILED)
    assert "was not fetched by the agent" in failed.message
    _untouched(user)
    # nor does another source replace it
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", version=2, storage_uri=str(model_source(tmp_path)))
    await fake.event("iris", Event.LOAD_FAILED, version=2)
    _untouched(user)


async def test_a_storage_uri_in_the_repository_is_served_in_place_and_never_deleted(setup, http):
    fake, agent, worker = await setup()
    user = _users_model(agent.config.repository)
    # Before: the LOAD swapped the source out of its own path and the UNLOAD deleted it.
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, "iris", storage_uri=str(user))
    await fake.event("iris", Event.LOADED)
    assert await _infer_status(http, worker, "iris") == 200
    fake.send(agent_pb2.ModelOperation.UNLOAD_MODEL, "iris")
    await fake.event("iris", Event.UNLOADED)
    assert await _infer_status(http, worker, "iris") == 404
    _untouched(user)


async def test_a_name_the_repository_cannot_hold_fails_with_a_reason(setup, tmp_path):
    fake, agent, _worker = await setup()
    # Before: the clean-up after the failed fetch raised on the name too, so no event was sent.
    fake.send(agent_pb2.ModelOperation.LOAD_MODEL, ".hidden", storage_uri=str(model_source(tmp_path)))
    failed = await fake.event(".hidden", Event.LOAD_FAILED)
    assert "cannot be a repository directory" in failed.message
    assert agent.state.get(".hidden") is None


async def test_at_start_an_interrupted_fetchs_leftovers_are_deleted(setup, tmp_path):
    repo = tmp_path / "repo"
    for leftover in (".iris.staging-0123abcd", ".iris.old-89abcdef"):
        (repo / leftover).mkdir()
        (repo / leftover / "weights.bin").write_bytes(b"half")
    user = _users_model(repo)
    await setup()
    assert sorted(p.name for p in repo.iterdir()) == ["iris"]
    _untouched(user)
