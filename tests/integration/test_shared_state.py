"""kv_aware affinity shared across gateways through a real redis-server; graceful when it is gone."""

from __future__ import annotations

import contextlib
import socket
import uuid
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis

from modelyard.balancing.strategies import affinity_key
from modelyard.config import KvAwareConfig
from modelyard.errors import StateUnavailable
from modelyard.protocols.openai import routing_request
from modelyard.state import Entry, RedisState
from support import metric_value, model_config, wait_until

CHAT = "/v1/chat/completions"


def chat(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def test_affinity_learned_on_one_gateway_is_a_hit_on_another(sim_workers, gateways, http, redis_url):
    workers = await sim_workers(3)
    state = {"backend": "redis", "url": redis_url, "key_prefix": f"test-{uuid.uuid4().hex}:"}
    models = [model_config("m", workers, strategy="kv_aware")]
    gateway_a = await gateways(models, state=state, seed=1)
    gateway_b = await gateways(models, state=state, seed=2)

    for i in range(6):
        prompt = f"system prompt number {i} " * 10
        async with http.post(gateway_a.url + CHAT, json=chat(prompt)) as first:
            assert first.headers["X-Modelyard-Cache-Hit"] == "false"
        async with http.post(gateway_b.url + CHAT, json=chat(prompt)) as second:
            assert second.headers["X-Modelyard-Cache-Hit"] == "true"
            assert second.headers["X-Modelyard-Backend"] == first.headers["X-Modelyard-Backend"]
    assert await metric_value(http, gateway_b.url, "modelyard_kv_affinity_total", result="hit") == 6
    assert await metric_value(http, gateway_b.url, "modelyard_state_fallback_total") == 0


async def test_unreachable_redis_falls_back_to_local_routing(sim_workers, gateways, http, caplog):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    workers = await sim_workers(2)
    gateway = await gateways(
        [model_config("m", workers, strategy="kv_aware")], state={"backend": "redis", "url": dead}
    )

    backends = set()
    for _ in range(3):
        async with http.post(gateway.url + CHAT, json=chat("same prompt")) as response:
            assert response.status == 200
            backends.add(response.headers["X-Modelyard-Backend"])
    # Local affinity still keeps the prompt on one endpoint while Redis is away.
    assert len(backends) == 1
    assert await metric_value(http, gateway.url, "modelyard_state_fallback_total") >= 1
    assert any("shared state unavailable" in record.getMessage() for record in caplog.records)


def _redis_key(prefix: str, content: str) -> str:
    """The Redis key a gateway stores a chat prompt's kv_aware affinity under (model "m")."""
    prompt = routing_request(orjson.dumps(chat(content)), "chat").prompt
    return prefix + affinity_key("m", prompt, KvAwareConfig().prefix_chars)


async def _backend(http, gateway, content: str) -> tuple[str, str]:
    async with http.post(gateway.url + CHAT, json=chat(content)) as response:
        assert response.status == 200
        return response.headers["X-Modelyard-Backend"], response.headers["X-Modelyard-Cache-Hit"]


async def _wait_for_affinities(redis: aioredis.Redis, keys: list[str], gateways_ready) -> None:
    """Poll, bounded, until `gateways_ready()` (which sends the traffic that lets a gateway notice
    Redis is back) holds and Redis holds every key."""
    ready, held = False, 0

    async def converged() -> bool:
        nonlocal ready, held
        ready = await gateways_ready()
        held = await redis.exists(*keys)
        return ready and held == len(keys)

    try:
        await wait_until(converged, attempts=300, interval=0.05)
    except AssertionError:
        raise AssertionError(
            f"after Redis came back: gateways ready {ready}, Redis holds {held} of {len(keys)} affinities"
        ) from None


@pytest.fixture
async def redis_client(redis_server) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.mark.parametrize("connected_before", [True, False], ids=["connected-before", "started-during-outage"])
async def test_affinities_learnt_during_an_outage_converge_after_redis_restarts_empty(
    sim_workers, gateways, http, redis_server, redis_client, connected_before
):
    workers = await sim_workers(3)
    prefix = f"test-{uuid.uuid4().hex}:"
    state = {"backend": "redis", "url": redis_server.url, "key_prefix": prefix}
    models = [model_config("m", workers, strategy="kv_aware")]
    gateway_a = await gateways(models, state=state, seed=1)
    gateway_b = await gateways(models, state=state, seed=2)
    if connected_before:  # Redis then comes back with a new run_id, else it is the first one seen
        for gateway in (gateway_a, gateway_b):
            await _backend(http, gateway, "before the outage")
    redis_server.stop()
    prompts = [f"prompt {i} learnt during the outage " * 8 for i in range(60)]
    learnt = []
    for content in prompts:
        on_a, _ = await _backend(http, gateway_a, content)
        on_b, _ = await _backend(http, gateway_b, content)
        learnt.append((on_a, on_b))
    assert any(on_a != on_b for on_a, on_b in learnt)  # each gateway learnt its own affinities
    assert await metric_value(http, gateway_a.url, "modelyard_state_fallback_total") >= 1

    redis_server.start()  # empty: everything learnt before and during the outage is gone
    probes = iter(range(1_000_000))

    async def both_gateways_read_redis() -> bool:
        # A prompt neither gateway has seen, routed by one, is a hit on the other only through Redis.
        n = next(probes)
        await _backend(http, gateway_a, f"probe {n} from a " * 8)
        _, hit_on_b = await _backend(http, gateway_b, f"probe {n} from a " * 8)
        await _backend(http, gateway_b, f"probe {n} from b " * 8)
        _, hit_on_a = await _backend(http, gateway_a, f"probe {n} from b " * 8)
        return (hit_on_a, hit_on_b) == ("true", "true")

    await _wait_for_affinities(
        redis_client, [_redis_key(prefix, p) for p in prompts], both_gateways_read_redis
    )

    for content, (on_a, on_b) in zip(prompts, learnt, strict=True):
        again_on_a, hit_a = await _backend(http, gateway_a, content)
        again_on_b, hit_b = await _backend(http, gateway_b, content)
        assert again_on_a == again_on_b, content
        assert again_on_a in (on_a, on_b)  # one of the affinities learnt, not a fresh pick
        assert (hit_a, hit_b) == ("true", "true")
    written = [
        await metric_value(http, g.url, "modelyard_state_writeback_total") for g in (gateway_a, gateway_b)
    ]
    assert sum(written) >= len(prompts)  # every prompt's affinity went back, by one gateway or the other


async def test_affinities_are_written_back_when_redis_restarts_empty_between_two_requests(
    sim_workers, gateways, http, redis_server, redis_client
):
    workers = await sim_workers(3)
    prefix = f"test-{uuid.uuid4().hex}:"
    state = {"backend": "redis", "url": redis_server.url, "key_prefix": prefix}
    models = [model_config("m", workers, strategy="kv_aware")]
    gateway_a = await gateways(models, state=state, seed=1)
    gateway_b = await gateways(models, state=state, seed=2)

    prompts = [f"prompt {i} learnt before the restart " * 8 for i in range(60)]
    learnt = [(await _backend(http, gateway_a, content))[0] for content in prompts]

    # Restarted between two requests: nothing was learnt while it was away, yet all of it is lost.
    # Whether the client even reports a failed command first depends on its version and retries.
    redis_server.stop()
    redis_server.start()

    async def one_request_on_a() -> bool:
        await _backend(http, gateway_a, prompts[0])
        return True

    await _wait_for_affinities(redis_client, [_redis_key(prefix, p) for p in prompts], one_request_on_a)

    for content, on_a in zip(prompts, learnt, strict=True):
        assert await _backend(http, gateway_b, content) == (on_a, "true")


async def test_redis_state_writes_back_without_overwriting_and_knows_restarts(redis_server, redis_client):
    state = RedisState(redis_server.url, key_prefix="wb:")
    try:
        assert state.epoch is None  # not connected yet
        await redis_client.set("wb:held", "theirs")
        entries = [Entry("held", "mine", 60), Entry("new", "mine", 30)]
        assert await state.set_many_if_absent(entries) == 1
        assert await state.get("held") == "theirs"
        assert await state.get("new") == "mine"
        assert 29_000 < await redis_client.pttl("wb:new") <= 30_000
        first = state.epoch
        assert first is not None

        redis_server.stop()
        redis_server.start()

        async def reconnected() -> bool:
            with contextlib.suppress(StateUnavailable):  # the first command may see the old socket
                await state.get("new")
            return state.epoch not in (None, first)

        await wait_until(reconnected)
        assert await state.get("new") is None
    finally:
        await state.close()
