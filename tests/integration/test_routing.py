"""Strategies through a real gateway over real sim workers."""

from __future__ import annotations

import orjson
import pytest

from modelyard.config import STRATEGY_NAMES
from support import metric_value, model_config, sim_stats, wait_until

CHAT = "/v1/chat/completions"


def chat(content: str = "hello", model: str = "m", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def post_backend(http, url: str, body: dict, headers: dict | None = None) -> str:
    async with http.post(url + CHAT, json=body, headers=headers or {}) as response:
        assert response.status == 200, await response.text()
        await response.read()
        return response.headers["X-Modelyard-Backend"]


async def test_round_robin_cycles_exactly_over_three_endpoints(sim_workers, gateways, http):
    workers = await sim_workers(3)
    gateway = await gateways([model_config("m", workers, strategy="round_robin")])
    backends = [await post_backend(http, gateway.url, chat()) for _ in range(9)]
    assert backends == ["w0", "w1", "w2"] * 3
    assert [(await sim_stats(http, w))["requests_total"] for w in workers] == [3, 3, 3]


async def test_weighted_round_robin_follows_weights(sim_workers, gateways, http):
    workers = await sim_workers(2)
    config = model_config("m", workers)
    config["endpoints"][0]["weight"] = 3
    gateway = await gateways([config])
    backends = [await post_backend(http, gateway.url, chat()) for _ in range(8)]
    assert backends.count("w0") == 6 and backends.count("w1") == 2


async def test_least_pending_never_picks_the_busy_endpoint(sim_workers, gateways, http):
    workers = await sim_workers(3, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("m", workers, strategy="least_pending")])
    # A long stream keeps one endpoint busy until we close it.
    long = await http.post(gateway.url + CHAT, json=chat("long", max_tokens=5000, stream=True))
    busy = long.headers["X-Modelyard-Backend"]
    await long.content.readline()  # the first event: the request is now running upstream
    try:
        picks = [await post_backend(http, gateway.url, chat(max_tokens=1)) for _ in range(12)]
    finally:
        long.close()
    assert busy not in picks
    assert set(picks) == {"w0", "w1", "w2"} - {busy}


async def test_kv_aware_hits_on_a_repeated_prompt(sim_workers, gateways, http):
    workers = await sim_workers(3)
    gateway = await gateways([model_config("m", workers, strategy="kv_aware")])
    prompt = "You are a helpful assistant. " * 20
    first = await http.post(gateway.url + CHAT, json=chat(prompt))
    assert first.headers["X-Modelyard-Cache-Hit"] == "false"
    again = [await http.post(gateway.url + CHAT, json=chat(prompt)) for _ in range(5)]
    assert {r.headers["X-Modelyard-Cache-Hit"] for r in again} == {"true"}
    assert {r.headers["X-Modelyard-Backend"] for r in again} == {first.headers["X-Modelyard-Backend"]}
    assert await metric_value(http, gateway.url, "modelyard_kv_affinity_total", result="hit") == 5
    assert await metric_value(http, gateway.url, "modelyard_kv_affinity_total", result="miss") == 1
    # The worker it stuck to served the prompt's blocks from its prefix cache.
    chosen = workers[int(first.headers["X-Modelyard-Backend"][1:])]
    assert (await sim_stats(http, chosen))["prefix_cache_hits_tokens"] > 0


async def test_kv_aware_moves_on_when_the_remembered_endpoint_is_gone(sim_workers, gateways, http):
    workers = await sim_workers(2)
    config = model_config("m", workers, strategy="kv_aware", health_check={"interval": "60s"})
    gateway = await gateways([config])
    first = await post_backend(http, gateway.url, chat("same prompt"))
    await workers[int(first[1:])].stop()
    moved = await http.post(gateway.url + CHAT, json=chat("same prompt"))
    assert moved.status == 200
    assert moved.headers["X-Modelyard-Backend"] != first
    assert moved.headers["X-Modelyard-Cache-Hit"] == "false"


async def test_cost_aware_prefers_the_cheapest_endpoint(sim_workers, gateways, http):
    workers = await sim_workers(3)
    config = model_config("m", workers, strategy="cost_aware")
    for endpoint, price in zip(config["endpoints"], (0.9, 0.1, 0.5), strict=True):
        endpoint["cost_per_1k_tokens"] = price
    gateway = await gateways([config])
    assert {await post_backend(http, gateway.url, chat()) for _ in range(5)} == {"w1"}


async def test_strategy_switch_at_runtime_keeps_affinity(sim_workers, gateways, http):
    workers = await sim_workers(3)
    gateway = await gateways(
        [model_config("m", workers, strategy="kv_aware"), model_config("other", workers)]
    )
    remembered = await post_backend(http, gateway.url, chat("sticky"))

    async with http.put(gateway.url + "/admin/strategy", json={"strategy": "round_robin"}) as response:
        assert response.status == 200
        body = await response.json()
    assert body["models"] == {"m": "round_robin", "other": "round_robin"}
    async with http.post(gateway.url + CHAT, json=chat("sticky")) as response:
        assert response.headers["X-Modelyard-Strategy"] == "round_robin"
        assert "X-Modelyard-Cache-Hit" not in response.headers

    # InferFlow's path, one model only; the affinity learned before the switch still holds.
    async with http.put(gateway.url + "/strategy", json={"strategy": "kv_aware", "model": "m"}) as response:
        assert (await response.json())["models"] == {"m": "kv_aware", "other": "round_robin"}
    async with http.post(gateway.url + CHAT, json=chat("sticky")) as response:
        assert response.headers["X-Modelyard-Cache-Hit"] == "true"
        assert response.headers["X-Modelyard-Backend"] == remembered
    async with http.get(gateway.url + "/strategy") as response:
        body = await response.json()
    # The switch for every model set the default; the one for m overrides it.
    assert (body["strategy"], body["default"], body["overrides"]) == (
        "round_robin",
        "round_robin",
        {"m": "kv_aware"},
    )


async def strategies(http, url: str, path: str = "/strategy") -> tuple:
    """`strategy`, `default` and `overrides` as GET /strategy (or `path`) answers them."""
    async with http.get(url + path) as response:
        body = await response.json()
    return body["strategy"], body["default"], body["overrides"]


async def test_the_strategy_read_is_the_one_every_model_runs_else_the_default(sim_workers, gateways, http):
    workers = await sim_workers(1)
    # InferFlow's clients read `strategy`: what runs. One model on round_robin, no scheduler: that.
    alone = await gateways([model_config("m", workers)])
    assert await strategies(http, alone.url) == ("round_robin", "round_robin", {})
    async with http.put(alone.url + "/strategy", json={"strategy": "kv_aware", "model": "m"}) as response:
        assert response.status == 200
    # Every model (the one) runs kv_aware; the default is still the configured one.
    assert await strategies(http, alone.url) == ("kv_aware", "round_robin", {"m": "kv_aware"})

    # Models that differ: the default, placement.models.strategy, since they agree on none.
    mixed = await gateways([model_config("m", workers), model_config("n", workers, strategy="random")])
    assert await strategies(http, mixed.url, "/admin/strategy") == (
        "least_pending",
        "least_pending",
        {"m": "round_robin", "n": "random"},
    )
    # A switch for every model, even to that default, then one model's: the switch is the default.
    async with http.put(mixed.url + "/admin/strategy", json={"strategy": "least_pending"}) as response:
        assert await response.json() == {
            "strategy": "least_pending",
            "default": "least_pending",
            "models": {"m": "least_pending", "n": "least_pending"},
            "overrides": {},
            "available": list(STRATEGY_NAMES),
        }
    async with http.put(mixed.url + "/admin/strategy", json={"strategy": "random", "model": "m"}) as response:
        assert response.status == 200
    assert await strategies(http, mixed.url) == ("least_pending", "least_pending", {"m": "random"})


async def test_unknown_strategy_is_400_listing_valid_names(sim_workers, gateways, http):
    workers = await sim_workers(1)
    gateway = await gateways([model_config("m", workers)])
    async with http.put(gateway.url + "/admin/strategy", json={"strategy": "fastest"}) as response:
        assert response.status == 400
        message = (await response.json())["error"]["message"]
    for name in ("round_robin", "random", "least_pending", "kv_aware", "cost_aware", "resource_aware"):
        assert name in message
    async with http.get(gateway.url + "/admin/strategy") as response:
        body = await response.json()
    assert (body["models"], body["default"]) == ({"m": "round_robin"}, "round_robin")  # nothing changed


async def test_admin_token_is_required_when_configured(sim_workers, gateways, http):
    workers = await sim_workers(1)
    gateway = await gateways([model_config("m", workers)], admin={"token": "s3cret"})
    for path in ("/admin/strategy", "/strategy"):
        async with http.put(gateway.url + path, json={"strategy": "random"}) as response:
            assert response.status == 401
            assert (await response.json())["error"]["type"] == "authentication_error"
        async with http.get(gateway.url + path, headers={"Authorization": "Bearer wrong"}) as response:
            assert response.status == 401
    ok = {"Authorization": "Bearer s3cret"}
    async with http.put(gateway.url + "/admin/strategy", json={"strategy": "random"}, headers=ok) as response:
        assert response.status == 200
    # Inference itself needs no admin token.
    assert await post_backend(http, gateway.url, chat()) == "w0"


async def test_request_id_is_propagated_or_created(sim_workers, gateways, http):
    workers = await sim_workers(1)
    gateway = await gateways([model_config("m", workers)])
    async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "abc-123"}) as response:
        assert response.headers["X-Request-Id"] == "abc-123"
    created = set()
    for _ in range(3):
        async with http.post(gateway.url + CHAT, json=chat()) as response:
            created.add(response.headers["X-Request-Id"])
    assert len(created) == 3 and all(len(i) == 32 for i in created)


async def test_a_refused_connection_fails_over_and_takes_the_endpoint_out(sim_workers, gateways, http):
    workers = await sim_workers(2)
    gateway = await gateways([model_config("m", workers, health_check={"interval": "60s"})])
    await workers[0].stop()
    backends = [await post_backend(http, gateway.url, chat()) for _ in range(4)]
    assert backends == ["w1"] * 4
    labels = {"model": "m", "backend": "w0", "to": "unhealthy"}
    assert await metric_value(http, gateway.url, "modelyard_endpoint_health_transitions_total", **labels) == 1


async def test_metrics_count_requests_by_model_backend_strategy_and_code(sim_workers, gateways, http):
    workers = await sim_workers(1)
    gateway = await gateways([model_config("m", workers)])
    for _ in range(3):
        await post_backend(http, gateway.url, chat())
    labels = {"model": "m", "backend": "w0", "strategy": "round_robin", "code": "200"}
    assert await metric_value(http, gateway.url, "modelyard_requests_total", **labels) == 3
    assert await metric_value(http, gateway.url, "modelyard_request_duration_seconds_count", model="m") == 3
    assert await metric_value(http, gateway.url, "modelyard_backend_in_flight", backend="w0") == 0


async def test_in_flight_gauge_counts_open_requests(sim_workers, gateways, http):
    workers = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("m", workers)])
    stream = await http.post(gateway.url + CHAT, json=chat(max_tokens=5000, stream=True))
    await stream.content.readline()
    assert await metric_value(http, gateway.url, "modelyard_backend_in_flight", backend="w0") == 1
    stream.close()

    async def drained() -> bool:
        return await metric_value(http, gateway.url, "modelyard_backend_in_flight", backend="w0") == 0

    await wait_until(drained)


@pytest.mark.parametrize("strategy", ["random", "least_pending", "cost_aware"])
async def test_every_strategy_serves_requests(sim_workers, gateways, http, strategy):
    workers = await sim_workers(2)
    gateway = await gateways([model_config("m", workers, strategy=strategy)])
    async with http.post(gateway.url + CHAT, data=orjson.dumps(chat())) as response:
        assert response.status == 200
        assert response.headers["X-Modelyard-Strategy"] == strategy


async def test_an_endpoint_that_comes_back_is_used_again(sim_workers, gateways, http):
    workers = await sim_workers(2)
    health = {"interval": "60s", "unhealthy_interval": "20ms"}
    gateway = await gateways([model_config("m", workers, health_check=health)])
    port = workers[0].port
    await workers[0].stop()
    assert [await post_backend(http, gateway.url, chat()) for _ in range(3)] == ["w1"] * 3

    (revived,) = await sim_workers(1, port=port)
    assert revived.port == port

    async def w0_serves_again() -> bool:
        return await post_backend(http, gateway.url, chat()) == "w0"

    await wait_until(w0_serves_again)
    labels = {"model": "m", "backend": "w0", "to": "healthy"}
    assert await metric_value(http, gateway.url, "modelyard_endpoint_health_transitions_total", **labels) == 1


async def test_prefix_aware_sends_a_prompt_back_where_its_prefix_is_cached(sim_workers, gateways, http):
    workers = await sim_workers(3)
    gateway = await gateways([model_config("m", workers, strategy="prefix_aware")])
    system = "You are a helpful assistant who answers in short sentences. " * 8
    first = await http.post(gateway.url + CHAT, json=chat(system + "What is a prefix cache?"))
    assert first.headers["X-Modelyard-Cache-Hit"] == "false"
    home = first.headers["X-Modelyard-Backend"]
    # The same prompt, and another one sharing its long system prompt, go where it is cached.
    for question in ("What is a prefix cache?", "Why does it help?", "What is a prefix cache?"):
        async with http.post(gateway.url + CHAT, json=chat(system + question)) as response:
            body = await response.json()
            assert response.headers["X-Modelyard-Backend"] == home
            assert response.headers["X-Modelyard-Cache-Hit"] == "true"
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # A prompt nobody has seen goes to the least loaded endpoint (any: all are idle).
    async with http.post(gateway.url + CHAT, json=chat("Unrelated question?")) as response:
        assert response.headers["X-Modelyard-Cache-Hit"] == "false"


async def test_prefix_aware_spreads_a_hot_prefix_when_its_endpoint_is_busy(sim_workers, gateways, http):
    workers = await sim_workers(2, decode_ms_per_token=20.0)
    config = model_config("m", workers, strategy="prefix_aware", prefix_aware={"load_margin": 0})
    gateway = await gateways([config])
    prompt = "A long shared instruction block for every request. " * 10
    home = await post_backend(http, gateway.url, chat(prompt, max_tokens=1))
    # A long stream keeps the endpoint holding the prefix busy: the next ones go to the other.
    long = await http.post(gateway.url + CHAT, json=chat(prompt, max_tokens=5000, stream=True))
    assert long.headers["X-Modelyard-Backend"] == home
    await long.content.readline()
    try:
        picks = [await post_backend(http, gateway.url, chat(prompt, max_tokens=1)) for _ in range(3)]
    finally:
        long.close()
    assert set(picks) == {"w0", "w1"} - {home}
