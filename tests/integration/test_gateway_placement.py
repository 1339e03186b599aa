"""The gateway follows the scheduler's feed: a fake scheduler, real sim-workers, a real gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from fake_scheduler import FakeScheduler
from modelyard.config import validate_config
from modelyard.gateway import GATEWAY, RunningGateway, start_gateway
from support import free_ports, model_config, wait_until

CHAT = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OIP = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


@pytest.fixture
async def scheduler() -> AsyncIterator[FakeScheduler]:
    fake = await FakeScheduler().start()
    yield fake
    await fake.stop()


@pytest.fixture
async def placed_gateway(scheduler) -> AsyncIterator[Any]:
    """`await placed_gateway(models=[...], **placement)`: a gateway following `scheduler`."""
    started: list[RunningGateway] = []

    async def start(models: list[dict[str, Any]] | None = None, **placement: Any) -> RunningGateway:
        settings = {
            "scheduler": scheduler.url,
            "retry_after": 3,
            "ping_timeout": 2.0,
            "reconnect_base_interval": 0.02,
            "reconnect_max_interval": 0.1,
            "models": {"health_check": {"interval": "60s"}},
            **placement,
        }
        data = {"listen": {"port": 0}, "models": models or [], "placement": settings}
        gateway = await start_gateway(validate_config(data, "<test>"), seed=0)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        await gateway.stop()


async def chat(http: aiohttp.ClientSession, gateway: RunningGateway) -> tuple[int, str, Any]:
    async with http.post(gateway.url + "/v1/chat/completions", json=CHAT) as response:
        return response.status, response.headers.get("X-Modelyard-Backend", ""), await response.json()


def routable(http: aiohttp.ClientSession, gateway: RunningGateway, status: int = 200) -> Any:
    async def check() -> bool:
        return (await chat(http, gateway))[0] == status

    return check


async def test_a_model_placed_before_start_serves_from_the_first_request(
    scheduler, placed_gateway, sim_workers, http
):
    (worker,) = await sim_workers(1, models=["llm"])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", worker.url)])
    gateway = await placed_gateway()  # start-up waits for the snapshot

    status, backend, body = await chat(http, gateway)
    assert (status, backend) == (200, "mlserver-0"), body
    async with http.post(gateway.url + "/v2/models/llm/infer", json=OIP) as response:
        assert response.status == 200
        assert (await response.json())["model_name"] == "llm"
    async with http.get(gateway.url + "/v2/models/llm/ready") as response:
        assert response.status == 200
    async with http.get(gateway.url + "/v1/models") as response:
        assert [m["id"] for m in (await response.json())["data"]] == ["llm"]
    async with http.get(gateway.url + "/openapi.json") as response:
        assert "/v2/models/{name}/infer" in (await response.json())["paths"]


async def test_a_model_pushed_available_becomes_routable(scheduler, placed_gateway, sim_workers, http):
    (worker,) = await sim_workers(1, models=["llm"])
    gateway = await placed_gateway()
    assert (await chat(http, gateway))[0] == 404

    scheduler.place("llm", "ModelAvailable", [("mlserver-0", worker.url)])
    await wait_until(routable(http, gateway))
    cluster = gateway.app[GATEWAY].clusters["llm"]
    assert cluster.balancer.strategy.name == "least_pending"  # placement.models defaults
    assert cluster.config.health_check.path == "/v2/health/live"
    async with http.post(gateway.url + "/v1/models/llm:predict", json={"instances": [[1]]}) as response:
        assert response.status == 200  # KServe v1


async def test_endpoints_change_live(scheduler, placed_gateway, sim_workers, http):
    w0, w1 = await sim_workers(2, models=["llm"])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", w0.url)])
    gateway = await placed_gateway()
    kept = gateway.app[GATEWAY].clusters["llm"].endpoints[0]

    scheduler.place("llm", "ModelAvailable", [("mlserver-0", w0.url), ("mlserver-1", w1.url)])

    async def new_replica_gets_traffic() -> bool:
        return (await chat(http, gateway))[1] == "mlserver-1"

    await wait_until(new_replica_gets_traffic, attempts=200)
    cluster = gateway.app[GATEWAY].clusters["llm"]
    assert cluster.endpoints[0] is kept  # the endpoint that stayed kept its state

    scheduler.place("llm", "ModelAvailable", [("mlserver-1", w1.url)])
    await wait_until(lambda: _async(len(cluster.endpoints) == 1))
    backends = {(await chat(http, gateway))[1] for _ in range(10)}
    assert backends == {"mlserver-1"}  # the removed replica gets nothing from then on


async def test_replicas_that_left_leave_no_load_or_metric_behind(
    scheduler, placed_gateway, sim_workers, http
):
    w0, w1 = await sim_workers(2, models=["llm"])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", w0.url)])
    gateway = await placed_gateway()
    state = gateway.app[GATEWAY]
    # The replica comes back at another address, as a pod does, then the model goes away.
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", w1.url)])
    await wait_until(lambda: _async(state.clusters["llm"].endpoints[0].url == w1.url))
    assert set(state.loads) == {w1.url}
    async with http.get(gateway.url + "/metrics") as response:
        series = [line for line in (await response.text()).splitlines() if "backend_in_flight{" in line]
    assert series == ['modelyard_backend_in_flight{backend="mlserver-0"} 0.0']
    scheduler.remove("llm")
    await wait_until(lambda: _async("llm" not in state.clusters))
    assert state.loads == {}


async def test_a_model_not_available_answers_503_with_retry_after_in_each_protocol(
    scheduler, placed_gateway, sim_workers, http
):
    (worker,) = await sim_workers(1, models=["llm"])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", worker.url)])
    gateway = await placed_gateway()
    assert (await chat(http, gateway))[0] == 200

    scheduler.place("llm", "ModelProgressing", [], reason="loading on mlserver-1")
    await wait_until(routable(http, gateway, 503))
    async with http.post(gateway.url + "/v1/chat/completions", json=CHAT) as response:
        assert response.headers["Retry-After"] == "3"
        error = (await response.json())["error"]
    assert error["code"] == "model_not_available"
    assert "ModelProgressing" in error["message"] and "loading on mlserver-1" in error["message"]
    async with http.post(gateway.url + "/v2/models/llm/infer", json=OIP) as response:
        assert (response.status, response.headers["Retry-After"]) == (503, "3")
        assert "ModelProgressing" in (await response.json())["error"]
    async with http.post(gateway.url + "/v1/models/llm:predict", json={"instances": [[1]]}) as response:
        assert response.status == 503
        assert "ModelProgressing" in (await response.json())["error"]
    async with http.get(gateway.url + "/readyz") as response:
        assert response.status == 200  # a placed model waiting for replicas does not fail readiness
        assert (await response.json())["placement"]["not_available"] == {"llm": "ModelProgressing"}

    scheduler.place("llm", "ModelAvailable", [("mlserver-0", worker.url)])
    await wait_until(routable(http, gateway))


async def test_a_placed_replica_that_is_down_does_not_make_the_gateway_unready(
    scheduler, placed_gateway, http
):
    (dead,) = free_ports(1)  # nothing listens there: the probe fails
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", f"http://127.0.0.1:{dead}")])
    gateway = await placed_gateway()
    cluster = gateway.app[GATEWAY].clusters["llm"]
    await wait_until(lambda: _async(not cluster.ready), attempts=500)  # two failed probes, 1 s apart
    async with http.get(gateway.url + "/readyz") as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["models_without_healthy_endpoints"] == []


async def test_a_removed_model_is_404_again(scheduler, placed_gateway, sim_workers, http):
    (worker,) = await sim_workers(1, models=["llm"])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", worker.url)])
    gateway = await placed_gateway()
    assert (await chat(http, gateway))[0] == 200

    scheduler.remove("llm")
    await wait_until(routable(http, gateway, 404))
    async with http.post(gateway.url + "/v1/chat/completions", json=CHAT) as response:
        assert (await response.json())["error"]["code"] == "model_not_found"
    async with http.get(gateway.url + "/v1/models") as response:
        assert (await response.json())["data"] == []


async def test_a_broken_feed_keeps_the_last_endpoints_and_resyncs(
    scheduler, placed_gateway, sim_workers, http
):
    w0, w1 = await sim_workers(2, models=["llm", "other"])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", w0.url)])
    gateway = await placed_gateway()
    follower = gateway.app[GATEWAY].follower
    assert follower is not None and follower.connected

    scheduler.refuse_feeds = True
    scheduler.drop_feeds()
    await wait_until(lambda: _async(not follower.connected and follower.reconnects >= 2))
    assert (await chat(http, gateway))[:2] == (200, "mlserver-0")  # the last endpoints serve on
    async with http.get(gateway.url + "/readyz") as response:
        assert response.status == 200
        assert (await response.json())["placement"]["connected"] is False

    # While the gateway is away, llm is removed and another model placed: the snapshot tells it.
    scheduler.entries.clear()
    scheduler.place("other", "ModelAvailable", [("mlserver-1", w1.url)])
    scheduler.refuse_feeds = False
    await wait_until(lambda: _async(follower.connected))
    assert (await chat(http, gateway))[0] == 404
    body = {**CHAT, "model": "other"}
    async with http.post(gateway.url + "/v1/chat/completions", json=body) as response:
        assert (response.status, response.headers["X-Modelyard-Backend"]) == (200, "mlserver-1")


async def test_a_silent_feed_is_taken_for_dead(scheduler, placed_gateway):
    gateway = await placed_gateway(ping_timeout=0.3)
    assert scheduler.feed_connections == 1
    scheduler.silence()  # the connection stays open; not even pings arrive
    await wait_until(lambda: _async(scheduler.feed_connections >= 2))
    scheduler.silence(False)
    await wait_until(lambda: _async(gateway.app[GATEWAY].follower.connected))  # type: ignore[union-attr]


async def test_a_configured_model_wins_over_a_placed_one(scheduler, placed_gateway, sim_workers, http):
    w0, w1 = await sim_workers(2, models=["llm"])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", w1.url)])
    scheduler.place("placed", "ModelAvailable", [("mlserver-0", w1.url)])
    gateway = await placed_gateway(models=[model_config("llm", [w0])])
    assert {(await chat(http, gateway))[1] for _ in range(5)} == {"w0"}

    scheduler.place("llm", "ModelFailed", [], reason="no server")
    scheduler.place("placed", "ModelAvailable", [])  # a later line: every earlier one was applied
    await wait_until(lambda: _async("placed" not in gateway.app[GATEWAY].clusters))
    assert (await chat(http, gateway))[:2] == (200, "w0")


async def test_a_switch_for_every_model_is_the_default_of_models_placed_later(
    scheduler, placed_gateway, sim_workers, http
):
    (worker,) = await sim_workers(1, models=["llm", "later", "parked"])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", worker.url)])
    scheduler.place("parked", "ModelAvailable", [("mlserver-0", worker.url)])
    gateway = await placed_gateway(models=[model_config("own", [worker], strategy="round_robin")])
    scheduler.place("parked", "ModelProgressing", [])  # placed again below, after the switch
    await wait_until(lambda: _async("parked" not in gateway.app[GATEWAY].clusters))
    async with http.get(gateway.url + "/admin/strategy") as response:
        before = await response.json()
    # Models that appear later start with placement.models.strategy; the configured one runs its own.
    assert (before["strategy"], before["default"]) == ("least_pending", "least_pending")
    assert before["overrides"] == {"own": "round_robin"}

    async with http.put(gateway.url + "/admin/strategy", json={"strategy": "kv_aware"}) as response:
        assert response.status == 200
    scheduler.place("later", "ModelAvailable", [("mlserver-0", worker.url)])
    scheduler.place("parked", "ModelAvailable", [("mlserver-0", worker.url)])
    for model in ("later", "parked"):
        body = {**CHAT, "model": model}

        async def answered(body: dict[str, Any] = body) -> bool:
            async with http.post(gateway.url + "/v1/chat/completions", json=body) as response:
                return response.status == 200

        await wait_until(answered)
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as response:
            assert response.headers["X-Modelyard-Strategy"] == "kv_aware"
    async with http.get(gateway.url + "/admin/strategy") as response:
        after = await response.json()
    assert (after["strategy"], after["default"], after["overrides"]) == ("kv_aware", "kv_aware", {})
    assert after["models"] == {
        "own": "kv_aware",
        "llm": "kv_aware",
        "later": "kv_aware",
        "parked": "kv_aware",
    }

    # One model's switch is an override of the default, not "mixed".
    async with http.put(
        gateway.url + "/admin/strategy", json={"strategy": "random", "model": "llm"}
    ) as response:
        one = await response.json()
    assert (one["strategy"], one["default"], one["overrides"]) == ("kv_aware", "kv_aware", {"llm": "random"})


async def test_a_gateway_starts_without_its_scheduler(placed_gateway, http):
    (port,) = free_ports(1)
    gateway = await placed_gateway(scheduler=f"127.0.0.1:{port}", startup_wait=0.1)
    async with http.get(gateway.url + "/readyz") as response:
        assert response.status == 200
        placement = (await response.json())["placement"]
    assert placement["connected"] is False and placement["synced"] is False
    assert "connection refused" in placement["last_error"]


async def _async(value: bool) -> bool:
    return value


def _versions(*groups: tuple[int, str, int]) -> Any:
    """A feed entry of model llm: (version, url, weight) per version, endpoint sim-<version>."""
    from modelyard.protocols.feed import FeedEndpoint, ModelChanged, PlacedModel, VersionShare

    endpoints = tuple(FeedEndpoint(f"sim-{v}", url, v) for v, url, _ in groups)
    shares = tuple(VersionShare(v, w) for v, _, w in groups)
    return ModelChanged(
        PlacedModel("llm", max(v for v, _, _ in groups), "ModelProgressing", "", endpoints, shares)
    )


@pytest.mark.parametrize("change", ["the split ends", "a split begins under an admin route"])
async def test_requests_queued_while_a_split_begins_or_ends_are_answered(sim_workers, http, change):
    w1, w2 = await sim_workers(2, models=["llm"], decode_ms_per_token=100.0)
    (closed,) = free_ports(1)
    limits = {"max_requests": 1, "max_pending_requests": 100, "queue_timeout": "10s"}
    placement = {
        "scheduler": f"127.0.0.1:{closed}",
        "startup_wait": 0.05,
        "models": {"health_check": {"interval": "60s"}, "circuit_breakers": limits},
    }
    gateway = await start_gateway(validate_config({"listen": {"port": 0}, "placement": placement}, "<test>"))
    try:
        placed = gateway.app[GATEWAY].placed
        if change == "the split ends":
            placed.apply(_versions((1, w1.url, 50), (2, w2.url, 50)))
        else:
            placed.apply(_versions((1, w1.url, 100)))
            gateway.app[GATEWAY].cluster("llm").replace_routes(
                [{"name": "mine", "destinations": [{"subset": "default"}]}]
            )
        cluster = gateway.app[GATEWAY].cluster("llm")
        requests = [asyncio.create_task(chat(http, gateway)) for _ in range(6)]
        await wait_until(lambda: _async(len(cluster.capacity) >= 3), attempts=500)  # most of them queue
        if change == "the split ends":
            placed.apply(_versions((2, w2.url, 100)))  # v1 still answers: its unload grace
        else:
            placed.apply(_versions((1, w1.url, 50), (2, w2.url, 50)))
        answers = await asyncio.gather(*requests)
    finally:
        await gateway.stop()
    # Before: the queued requests' subset (v1/v2, or default) was gone, and they got 503.
    assert [status for status, _, _ in answers] == [200] * 6, answers
