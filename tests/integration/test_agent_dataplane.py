"""The agent's data plane, memory overcommit, LRU eviction and lazy reload (issue 9 items 1 and 2),
between the fake scheduler of test_agent.py and a real sim-worker in repository mode whose own
memory is as small as the agent's: a load the agent did not make room for fails on the server."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from fake_agent_scheduler import OIP_BODY, model_source
from modelyard.rpc.agent_v1 import agent_pb2
from support import metric_value, wait_until

Event = agent_pb2.ModelEvent
LOAD, UNLOAD = agent_pb2.ModelOperation.LOAD_MODEL, agent_pb2.ModelOperation.UNLOAD_MODEL


async def start(setup: Any, **overrides: Any) -> tuple[Any, Any, Any]:
    """An agent with 1000 bytes and 100% overcommit over a sim-worker with 1000 bytes."""
    settings: dict[str, Any] = {"overcommit_percent": 100, "worker": {"memory": 1000}}
    settings.update(overrides)
    return await setup(**settings)


async def load(fake: Any, tmp_path: Any, name: str, size: int, **extra: Any) -> agent_pb2.ModelEvent:
    source = model_source(tmp_path, name, memory_bytes=size, **extra)
    fake.send(LOAD, name, storage_uri=str(source), memory_bytes=size)
    return await fake.event(name, Event.LOADED)


async def infer(http: aiohttp.ClientSession, url: str, name: str) -> tuple[int, Any]:
    async with http.post(f"{url}/v2/models/{name}/infer", json=OIP_BODY) as response:
        return response.status, await response.json()


async def resident(http: aiohttp.ClientSession, worker: Any) -> dict[str, int]:
    async with http.get(worker.url + "/sim/repository") as response:
        return dict((await response.json())["loaded"])


async def test_requests_pass_through_the_agent_and_are_counted(setup, http, tmp_path):
    fake, agent, _worker = await start(setup)
    await load(fake, tmp_path, "iris", 300)
    status, body = await infer(http, agent.url, "iris")
    assert status == 200 and body["model_name"] == "iris"
    # KServe v1 and OpenAI paths name the model too; the answer is the server's, as it came.
    async with http.post(f"{agent.url}/v1/models/iris:predict", json={"instances": [[1.0]]}) as response:
        assert response.status == 200
    chat = {"model": "iris", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with http.post(f"{agent.url}/v1/chat/completions", json={**chat, "stream": True}) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line async for line in response.content if line.startswith(b"data: ")]
    assert events[-1].strip() == b"data: [DONE]" and len(events) > 2
    # A model the agent does not hold is not forwarded: the agent answers 404 in OIP's envelope.
    status, body = await infer(http, agent.url, "nope")
    assert status == 404 and "error" in body
    assert (
        await metric_value(http, agent.url, "modelyard_agent_requests_total", model="iris", code="200") == 3
    )
    assert await metric_value(http, agent.url, "modelyard_agent_requests_in_flight", model="iris") == 0
    used = await metric_value(
        http, agent.url, "modelyard_agent_model_last_used_timestamp_seconds", model="iris"
    )
    assert used > 1.7e9  # Unix time
    async with http.get(agent.url + "/v2/health/ready") as response:
        assert response.status == 200


async def test_a_load_beyond_memory_evicts_the_least_recently_used_model(setup, http, tmp_path):
    fake, agent, worker = await start(setup)
    await load(fake, tmp_path, "a", 400)
    await load(fake, tmp_path, "b", 400)
    assert (await infer(http, agent.url, "a"))[0] == 200  # b is now the least recently used
    c = await load(fake, tmp_path, "c", 400)
    assert c.available_memory_bytes == 2000 - 1200  # registered models count, evicted or not
    assert await resident(http, worker) == {"a": 400, "c": 400}
    assert [m.name for m in agent.state.loaded()] == ["a", "b", "c"]  # b is still registered
    assert await metric_value(http, agent.url, "modelyard_evictions_total", model="b") == 1
    assert await metric_value(http, agent.url, "modelyard_agent_model_resident", model="b") == 0

    # A request for the evicted model reloads it (evicting the least recently used, a), then is served.
    status, body = await infer(http, agent.url, "b")
    assert status == 200 and body["model_name"] == "b"
    assert await resident(http, worker) == {"b": 400, "c": 400}
    assert (
        await metric_value(http, agent.url, "modelyard_agent_reloads_total", model="b", reason="evicted") == 1
    )
    assert await metric_value(http, agent.url, "modelyard_evictions_total", model="a") == 1
    # A repeated LOAD of an evicted version is answered LOADED without loading it.
    fake.send(LOAD, "a", memory_bytes=400)
    await fake.event("a", Event.LOADED, count=2)
    assert "a" not in await resident(http, worker)


async def test_requests_alternating_between_models_that_do_not_fit_together_are_all_answered(
    setup, http, tmp_path
):
    fake, agent, worker = await start(setup)
    await load(fake, tmp_path, "a", 700)
    await load(fake, tmp_path, "b", 700)

    async def one(name: str) -> int:
        return (await infer(http, agent.url, name))[0]

    statuses = [await one(name) for name in ["a", "b"] * 5]
    concurrent = await asyncio.gather(*(one(name) for name in ["a", "b"] * 4))
    assert statuses == [200] * 10 and list(concurrent) == [200] * 8
    assert sum((await resident(http, worker)).values()) <= 1000


async def test_a_model_serving_requests_is_not_evicted_the_reload_waits_for_it(setup, http, tmp_path):
    fake, agent, worker = await start(setup, worker={"memory": 1000, "decode_ms_per_token": 20.0})
    await load(fake, tmp_path, "a", 700)
    await load(fake, tmp_path, "b", 700)  # evicts a
    assert await resident(http, worker) == {"b": 700}
    # A slow request keeps b busy (about 0.6 s of decoding) while a request for a arrives.
    chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    slow = asyncio.ensure_future(http.post(f"{agent.url}/v1/chat/completions", json=chat))

    async def b_busy() -> bool:
        return agent.state.in_flight("b") == 1

    await wait_until(b_busy)
    reload = asyncio.ensure_future(infer(http, agent.url, "a"))

    async def a_queued() -> bool:
        return await metric_value(http, agent.url, "modelyard_agent_requests_queued", model="a") == 1

    await wait_until(a_queued)
    assert not slow.done() and await resident(http, worker) == {"b": 700}  # b stays while busy
    async with await slow as answer:
        assert answer.status == 200
    status, _ = await reload
    assert status == 200
    assert await resident(http, worker) == {"a": 700}


async def test_a_reload_that_gets_no_room_in_time_answers_503_in_the_protocols_shape(setup, http, tmp_path):
    fake, agent, _worker = await start(
        setup, room_timeout=0.2, worker={"memory": 1000, "decode_ms_per_token": 20.0}
    )
    await load(fake, tmp_path, "a", 700)
    await load(fake, tmp_path, "b", 700)
    chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    async with http.post(f"{agent.url}/v1/chat/completions", json=chat) as slow:
        pass  # warm: b is resident; now keep it busy
    slow_task = asyncio.ensure_future(http.post(f"{agent.url}/v1/chat/completions", json=chat))

    async def b_busy() -> bool:
        return agent.state.in_flight("b") == 1

    await wait_until(b_busy)
    status, body = await infer(http, agent.url, "a")
    assert status == 503
    assert "could not be loaded again" in body["error"] and "serving requests: b" in body["error"]
    chat_a = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with http.post(f"{agent.url}/v1/chat/completions", json=chat_a) as response:
        error = (await response.json())["error"]
        assert response.status == 503 and error["type"] == "service_unavailable"  # OpenAI's envelope
    async with await slow_task as answer:
        assert answer.status == 200 and slow.status == 200
    assert (await infer(http, agent.url, "a"))[0] == 200  # room once b is idle


async def test_a_server_that_lost_a_model_gets_it_loaded_again_and_the_request_retried(setup, http, tmp_path):
    fake, agent, worker = await start(setup)
    await load(fake, tmp_path, "a", 300)
    async with http.post(worker.url + "/v2/repository/models/a/unload", json={}) as response:
        assert response.status == 200  # as if the server had restarted
    status, body = await infer(http, agent.url, "a")
    assert status == 200 and body["model_name"] == "a"
    assert (
        await metric_value(http, agent.url, "modelyard_agent_reloads_total", model="a", reason="not_found")
        == 1
    )


async def test_unloading_an_evicted_model_forgets_it_and_a_resubscribe_reports_it(setup, http, tmp_path):
    fake, agent, worker = await start(setup)
    await load(fake, tmp_path, "a", 600)
    await load(fake, tmp_path, "b", 600)  # evicts a
    fake.drop()

    async def resubscribed() -> bool:
        return len(fake.subscribes) >= 2

    await wait_until(resubscribed, attempts=1000)
    assert sorted(m.name for m in fake.subscribes[1].loaded_models) == ["a", "b"]  # evicted a included
    fake.send(UNLOAD, "a")
    unloaded = await fake.event("a", Event.UNLOADED)
    assert unloaded.available_memory_bytes == 2000 - 600
    assert agent.state.get("a") is None and not (agent.config.repository / "a").exists()
    assert await resident(http, worker) == {"b": 600}


async def test_a_load_waiting_for_room_evicts_a_model_that_was_still_loading_when_it_came(
    setup, http, tmp_path
):
    """Two LOADs at once that do not fit together: the second waits for the first to finish
    loading (a model loading cannot be evicted), then evicts it."""
    fake, agent, worker = await start(setup, worker={"memory": 1000, "load_delay": 0.2})
    for name in ("a", "b"):
        source = model_source(tmp_path, name, memory_bytes=600)
        fake.send(LOAD, name, storage_uri=str(source), memory_bytes=600)
    await fake.event("a", Event.LOADED)
    await fake.event("b", Event.LOADED)
    assert await resident(http, worker) == {"b": 600}
    assert (await infer(http, agent.url, "a"))[0] == 200


async def test_a_404_about_a_path_leaves_a_ready_model_alone(setup, http, tmp_path):
    fake, agent, worker = await start(setup)
    await load(fake, tmp_path, "a", 300)
    async with http.post(f"{agent.url}/v2/models/a/explain", json=OIP_BODY) as response:
        assert response.status == 404  # the sim-worker has no explainer: its answer, as it is
    assert await metric_value(http, agent.url, "modelyard_agent_reloads_total", model="a") == 0
    async with http.get(worker.url + "/metrics") as response:
        assert 'modelyard_sim_model_loads_total{model="a"} 1.0' in await response.text()


async def test_finished_streams_give_their_connection_back(setup, http, tmp_path):
    fake, agent, _worker = await start(setup, max_server_connections=2)
    await load(fake, tmp_path, "a", 300)
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    for _ in range(5):  # more streams than the data plane may open connections to the server
        async with http.post(f"{agent.url}/v1/chat/completions", json=chat) as response:
            assert response.status == 200
            await response.read()
    async with asyncio.timeout(5):
        assert (await infer(http, agent.url, "a"))[0] == 200


async def test_a_client_leaving_during_a_reload_does_not_stop_it(setup, http, tmp_path):
    fake, agent, worker = await start(setup, worker={"memory": 1000, "load_delay": 0.3})
    await load(fake, tmp_path, "a", 600)
    await load(fake, tmp_path, "b", 600)  # evicts a
    with contextlib.suppress(TimeoutError):
        async with http.post(
            f"{agent.url}/v2/models/a/infer", json=OIP_BODY, timeout=aiohttp.ClientTimeout(total=0.05)
        ):
            pass
    # The reload goes on without the client; the next request finds a loaded (or its reload).
    status, body = await infer(http, agent.url, "a")
    assert status == 200 and body["model_name"] == "a"
    assert agent.state.get("a").status.value == "loaded"
    assert await resident(http, worker) == {"a": 600}


async def test_a_body_over_the_limit_gets_413_in_the_protocols_envelope(setup, http, tmp_path):
    _fake, agent, _worker = await start(setup, max_body_bytes=1000)
    big = {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["y" * 2000]}]}
    async with http.post(f"{agent.url}/v2/models/a/infer", json=big) as response:
        assert response.status == 413
        assert "max_body_bytes (1000 bytes)" in (await response.json())["error"]
    chat = {"model": "a", "messages": [{"role": "user", "content": "y" * 2000}]}
    async with http.post(f"{agent.url}/v1/chat/completions", json=chat) as response:
        assert response.status == 413 and (await response.json())["error"]["type"] == "invalid_request_error"
