"""What the dashboard reads, over HTTP: `/admin/overview`, `/admin/log` and the live stream of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jsonschema_rs  # comes with schemathesis
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from fake_scheduler import FakeScheduler
from modelyard.gateway import GATEWAY, RunningGateway
from modelyard.gateway import admin as admin_module
from modelyard.gateway.routing_log import DEFAULT_SIZE, REFUSED_BURST, REFUSED_PER_SECOND
from raw_http import send as send_raw
from support import free_ports, metric_value, model_config, wait_until

TOKEN = "dashboard-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = "/v1/chat/completions"


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def get_json(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    async with http.get(url, headers=headers or {}) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def send(
    http: aiohttp.ClientSession, url: str, request_id: str, **extra: Any
) -> aiohttp.ClientResponse:
    async with http.post(url + CHAT, json=chat(**extra), headers={"X-Request-Id": request_id}) as response:
        await response.read()
        return response


async def next_event(stream: aiohttp.ClientResponse) -> dict[str, str]:
    """The next event of a server-sent event stream, comments skipped: its fields."""
    while True:
        block = (await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 10)).decode()
        fields = dict(line.split(": ", 1) for line in block.strip().splitlines() if not line.startswith(":"))
        if fields:
            return fields


async def test_the_dashboards_admin_calls_need_the_token(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))], admin={"token": TOKEN})
    for path in ("/admin/overview", "/admin/log", "/admin/log/stream"):
        async with http.get(gateway.url + path, headers={"Authorization": "Bearer wrong"}) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            error = (await response.json())["error"]
            assert error["type"] == "authentication_error"
            assert "Authorization: Bearer" in error["message"]
        async with http.get(gateway.url + path, headers=AUTH) as response:
            assert response.status == 200
    overview = await get_json(http, gateway.url + "/admin/overview", AUTH)
    assert overview["admin_token_required"] is True
    assert TOKEN not in orjson.dumps(overview).decode()


async def test_the_overview_shows_each_endpoints_health_load_ejection_and_circuit(
    sim_workers, gateways, http
):
    failing = await sim_workers(1, fail_rate=1.0)
    workers = await sim_workers(2, decode_ms_per_token=20.0)
    (dead_port,) = free_ports(1)
    config = model_config(
        "m",
        [*failing, *workers],
        strategy="round_robin",
        outlier_detection={"consecutive_5xx": 2, "base_ejection_time": "30s"},
        circuit_breakers={"max_requests": 1},
    )
    config["endpoints"].append({"name": "dead", "url": f"http://127.0.0.1:{dead_port}"})
    gateway = await gateways([config])
    for i in range(6):  # w0 answers 500 twice: ejected
        await send(http, gateway.url, f"r{i}", max_tokens=1)
    long = await http.post(gateway.url + CHAT, json=chat("long", max_tokens=5000, stream=True))
    try:
        await long.content.readline()  # running upstream now: that endpoint is full
        overview = await get_json(http, gateway.url + "/admin/overview")
    finally:
        long.close()
    assert overview["admin_token_required"] is False
    assert "round_robin" in overview["strategies"]
    (model,) = overview["models"]
    assert (model["name"], model["strategy"], model["ready"]) == ("m", "round_robin", True)
    endpoints = {e["name"]: e for e in model["endpoints"]}
    assert list(endpoints) == ["w0", "w1", "w2", "dead"]
    assert endpoints["w1"]["url"] == workers[0].url
    assert endpoints["dead"]["health"]["status"] == "unhealthy"
    assert endpoints["dead"]["health"]["last_error"]
    assert endpoints["dead"]["routable"] is False
    ejection = endpoints["w0"]["ejection"]
    assert ejection["ejected"] is True and ejection["ejections"] == 1
    assert 0 < ejection["seconds_left"] <= 30
    assert endpoints["w0"]["health"]["status"] == "healthy" and endpoints["w0"]["routable"] is False
    busy = endpoints[long.headers["X-Modelyard-Backend"]]
    assert busy["in_flight"] == 1
    assert busy["circuit"] == {"state": "open", "max_requests": 1}
    idle = next(e for e in endpoints.values() if e["routable"] and e is not busy)
    assert idle["in_flight"] == 0 and idle["circuit"]["state"] == "closed"
    assert not idle["ejection"]["ejected"] and idle["ejection"]["seconds_left"] is None


async def test_the_log_records_where_each_request_went(sim_workers, gateways, http):
    workers = await sim_workers(2)
    (dead_port,) = free_ports(1)
    down = {"name": "down", "endpoints": [{"url": f"http://127.0.0.1:{dead_port}"}]}
    gateway = await gateways([model_config("m", workers, strategy="kv_aware"), down])
    answers = [await send(http, gateway.url, f"kv-{i}", content="the same prompt " * 10) for i in range(2)]
    async with http.post(gateway.url + CHAT, json={**chat(), "model": "down"}) as refused:
        assert refused.status == 503
    records = (await get_json(http, gateway.url + "/admin/log"))["records"]
    assert [r["seq"] for r in records] == [1, 2, 3]
    first, second, unrouted = records
    for record, answer in zip((first, second), answers, strict=True):
        assert record["request_id"] == answer.headers["X-Request-Id"]
        assert record["backend"] == answer.headers["X-Modelyard-Backend"]
        assert (record["model"], record["route"], record["subset"]) == ("m", "default", "*")
        assert (record["strategy"], record["status"]) == ("kv_aware", 200)
        assert record["latency_ms"] > 0 and record["time"] > 0
    assert (first["cache_hit"], second["cache_hit"]) == (False, True)
    assert unrouted["model"] == "down" and unrouted["backend"] == ""
    assert unrouted["status"] == 503 and unrouted["cache_hit"] is None


async def test_the_stream_sends_records_as_they_happen(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(2), strategy="round_robin")])
    await send(http, gateway.url, "before")
    async with http.get(gateway.url + "/admin/log/stream") as stream:
        assert stream.status == 200
        assert stream.content_type == "text/event-stream"
        assert await stream.content.readuntil(b"\n\n") == b": modelyard routing log\n\n"  # no replay asked
        answer = await send(http, gateway.url, "live")
        event = await next_event(stream)
    record = orjson.loads(event["data"])
    assert event["id"] == str(record["seq"]) == "2"
    assert record["request_id"] == "live"
    assert record["backend"] == answer.headers["X-Modelyard-Backend"]


async def test_last_event_id_replays_the_records_kept_after_it(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))])
    for i in range(3):
        await send(http, gateway.url, f"r{i}")
    async with http.get(gateway.url + "/admin/log/stream", headers={"Last-Event-ID": "1"}) as stream:
        replayed = [await next_event(stream) for _ in range(2)]
        await send(http, gateway.url, "r3")
        live = await next_event(stream)
    assert [orjson.loads(e["data"])["request_id"] for e in [*replayed, live]] == ["r1", "r2", "r3"]


async def test_a_stream_that_falls_behind_is_told_how_many_records_it_lost(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))])
    log = gateway.app[GATEWAY].metrics.routing_log
    log.subscriber_queue = 2
    async with http.get(gateway.url + "/admin/log/stream") as stream:
        await stream.content.readuntil(b"\n\n")
        for _ in range(10):  # in one go, as a burst of answers would while the stream's writes wait
            log.record("m", "default", "*", "w0", "round_robin", 200, 0.001, None, "burst")
        events = [await next_event(stream) for _ in range(3)]
    assert [e.get("id") for e in events] == ["1", "2", None]
    assert events[2]["event"] == "dropped"
    assert orjson.loads(events[2]["data"]) == {"dropped": 8}


async def test_an_idle_stream_gets_heartbeats(sim_workers, gateways, http, monkeypatch):
    monkeypatch.setattr(admin_module, "HEARTBEAT_SECONDS", 0.05)
    gateway = await gateways([model_config("m", await sim_workers(1))])
    async with http.get(gateway.url + "/admin/log/stream") as stream:
        await stream.content.readuntil(b"\n\n")
        assert await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 5) == b": heartbeat\n\n"


@pytest.mark.parametrize("reading", [True, False])
async def test_the_stream_ends_cleanly_when_the_gateway_stops(sim_workers, gateways, http, reading):
    gateway = await gateways([model_config("m", await sim_workers(1))])  # shutdown_timeout 20 s
    async with http.get(gateway.url + "/admin/log/stream") as stream:
        await stream.content.readuntil(b"\n\n")
        reader = asyncio.ensure_future(stream.content.read()) if reading else None
        await asyncio.wait_for(gateway.stop(), 5)  # not held for the shutdown timeout by the stream
        rest = await (reader if reader is not None else stream.content.read())
    assert rest == b""
    assert gateway.app[GATEWAY].metrics.routing_log.subscribers == 0


async def no_subscribers(gateway: Any) -> None:
    log = gateway.app[GATEWAY].metrics.routing_log

    async def gone() -> bool:
        return log.subscribers == 0

    await wait_until(gone)


@pytest.mark.parametrize(
    "last",
    [
        "garbage",
        "9" * 4301,  # more digits than int() converts: a ValueError before the fix
        "12345678901234567890",  # 20 digits: no seq gets there
        "-1",
        "0x10",
        "1e3",
        "١٢",  # Arabic-Indic digits: str.isdigit says yes
    ],
)
async def test_a_bad_last_event_id_is_ignored_and_nothing_stays_subscribed(sim_workers, gateways, http, last):
    """EventSource resends the last id it saw: an id that is not a `seq` must not break the stream
    (nor leave a subscriber behind that every request keeps feeding)."""
    gateway = await gateways([model_config("m", await sim_workers(1))])
    await send(http, gateway.url, "before")
    async with http.get(gateway.url + "/admin/log/stream", headers={"Last-Event-ID": last}) as stream:
        assert stream.status == 200, await stream.text()
        assert await stream.content.readuntil(b"\n\n") == b": modelyard routing log\n\n"  # no replay
        await send(http, gateway.url, "live")
        event = await next_event(stream)
    assert orjson.loads(event["data"])["request_id"] == "live"
    await no_subscribers(gateway)


async def test_a_reader_that_disconnects_is_unsubscribed(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))])
    log = gateway.app[GATEWAY].metrics.routing_log
    async with http.get(gateway.url + "/admin/log/stream") as stream:
        await stream.content.readuntil(b"\n\n")
        assert log.subscribers == 1
    await no_subscribers(gateway)
    assert (await send(http, gateway.url, "after")).status == 200


async def test_streams_beyond_max_log_streams_get_503_with_retry_after(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))], admin={"max_log_streams": 1})
    url = gateway.url + "/admin/log/stream"
    async with http.get(url) as first:
        await first.content.readuntil(b"\n\n")
        async with http.get(url, headers={"Last-Event-ID": "0"}) as refused:
            assert refused.status == 503
            assert refused.headers["Retry-After"] == "5"
            error = (await refused.json())["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "too_many_log_streams")
        assert "admin.max_log_streams" in error["message"]
        assert await metric_value(http, gateway.url, "modelyard_log_streams_open") == 1
        assert await metric_value(http, gateway.url, "modelyard_log_streams_refused_total") == 1
        await send(http, gateway.url, "live")
        assert orjson.loads((await next_event(first))["data"])["request_id"] == "live"
    await no_subscribers(gateway)
    assert await metric_value(http, gateway.url, "modelyard_log_streams_open") == 0
    async with http.get(url) as again:  # room again
        assert again.status == 200
        await again.content.readuntil(b"\n\n")


async def test_the_dashboard_with_a_trailing_slash_sends_the_browser_to_the_page(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))])
    for query in ("", "?model=m", "?q=a%20b%26c"):  # the query as sent
        asked, location = "/dashboard/" + query, "/dashboard" + query
        async with http.get(gateway.url + asked, allow_redirects=False) as response:
            assert response.status == 307
            assert response.headers["Location"] == location
    async with http.get(gateway.url + "/dashboard/") as followed:
        assert followed.status == 200 and followed.content_type == "text/html"
        assert str(followed.url) == gateway.url + "/dashboard"
        assert "modelyard dashboard" in await followed.text()


# --- what the dashboard learnt from a new user's first hour (issue 27) --------------------------


@pytest.fixture
async def scheduler() -> AsyncIterator[FakeScheduler]:
    fake = await FakeScheduler().start()
    yield fake
    await fake.stop()


# chat-huge as the real scheduler's feed says it (examples/placement/models.yaml): nowhere to go
HUGE = {
    "name": "chat-huge",
    "version": 1,
    "state": "ScheduleFailed",
    "reason": "Failed to schedule model as no matching servers are available",
    "available_replicas": 0,
    "unavailable_replicas": 1,
    "endpoints": [],
}


async def placed_gateway(
    gateways: Any, scheduler: FakeScheduler, models: list[dict[str, Any]]
) -> RunningGateway:
    scheduler.entries["chat-huge"] = HUGE  # in the snapshot the gateway waits for at start
    placement = {"scheduler": scheduler.url, "models": {"health_check": {"interval": "60s"}}}
    return await gateways(models, placement=placement)


def raw_post(path: str, body: bytes, request_id: str, listener: str) -> bytes:
    """A POST the lean listener reads (Content-Length), or one it hands to aiohttp (chunked)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Request-Id: {request_id}\r\n"
    )
    if listener == "lean":
        return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    return f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


async def test_refused_requests_are_in_the_log_and_its_stream_from_either_listener(
    sim_workers, gateways, http, scheduler
):
    gateway = await placed_gateway(gateways, scheduler, [model_config("m", await sim_workers(1))])
    refused = [  # (path, model asked for, status)
        (CHAT, "nope", 404),  # no such model
        (CHAT, "chat-huge", 503),  # the scheduler knows it, but it has nowhere to run
        ("/v2/models/nope/infer", "nope", 404),  # the model in the path
    ]
    async with http.get(gateway.url + "/admin/log/stream") as stream:
        await stream.content.readuntil(b"\n\n")
        await send(http, gateway.url, "routed")
        for listener in ("lean", "aiohttp"):
            for path, model, status in refused:
                body = orjson.dumps(chat(model=model)) if path == CHAT else b"{}"
                reply = await send_raw(
                    gateway.url, raw_post(path, body, f"{listener}-{model}-{status}", listener)
                )
                assert reply.status == status, reply.body
        streamed = [orjson.loads((await next_event(stream))["data"]) for _ in range(7)]
    records = (await get_json(http, gateway.url + "/admin/log"))["records"]
    assert streamed == records  # once each, in both
    routed, *refusals = records
    assert (routed["request_id"], routed["refused"], routed["backend"]) == ("routed", False, "w0")
    seen = [(r["request_id"], r["model"], r["status"], r["refused"]) for r in refusals]
    assert seen == [
        (f"{listener}-{model}-{status}", model, status, True)
        for listener in ("lean", "aiohttp")
        for _path, model, status in refused
    ]
    for record in refusals:  # no route, strategy or backend: nothing was routed
        assert (record["route"], record["subset"], record["backend"], record["strategy"]) == ("", "", "", "")
        assert record["cache_hit"] is None and record["latency_ms"] >= 0


async def test_a_flood_of_refused_requests_leaves_the_routed_records_and_counts_those_left_out(
    sim_workers, gateways, http, clients
):
    gateway = await gateways([model_config("m", await sim_workers(1))])
    for i in range(3):
        await send(http, gateway.url, f"routed-{i}")
    flooding = await clients(gateway.url)  # anyone may ask for a model that is not there
    unknown = raw_post(CHAT, orjson.dumps(chat(model="nope")), "flood", "lean")
    flood = 2 * DEFAULT_SIZE  # as many refusals as the ring ever held records, twice over
    async with http.get(gateway.url + "/admin/log/stream") as stream:  # sees each record made
        await stream.content.readuntil(b"\n\n")
        started = time.monotonic()
        for _ in range(flood):
            assert (await flooding.exchange(unknown)).status == 404
        elapsed = time.monotonic() - started
        await send(http, gateway.url, "routed-after")
        recorded = 0
        while (record := orjson.loads((await next_event(stream))["data"]))["request_id"] != "routed-after":
            assert record["refused"] and record["request_id"] == "flood"
            recorded += 1
    assert 0 < recorded <= REFUSED_BURST + REFUSED_PER_SECOND * elapsed + 1  # a second's worth, then the rate
    records = (await get_json(http, gateway.url + "/admin/log"))["records"]
    routed = [r["request_id"] for r in records if not r["refused"]]
    assert routed == ["routed-0", "routed-1", "routed-2", "routed-after"]  # none pushed out
    assert sum(r["refused"] for r in records) == min(recorded, DEFAULT_SIZE // 2)
    left_out = await metric_value(http, gateway.url, "modelyard_log_refusals_unrecorded_total")
    assert left_out == flood - recorded


async def test_a_body_that_names_no_model_is_refused_and_logged_without_one(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))])
    for listener in ("lean", "aiohttp"):
        reply = await send_raw(gateway.url, raw_post(CHAT, b"{bad", f"bad-{listener}", listener))
        assert reply.status == 400
    records = (await get_json(http, gateway.url + "/admin/log"))["records"]
    assert [(r["request_id"], r["model"], r["status"], r["refused"]) for r in records] == [
        ("bad-lean", "", 400, True),
        ("bad-aiohttp", "", 400, True),
    ]


async def test_oip_grpc_calls_refused_before_routing_are_in_the_log(sim_workers, gateways, http):
    (worker,) = await sim_workers(1)
    gateway = await gateways(
        [model_config("m", [worker], protocol="v2")], listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0}
    )
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    tensor = grpcclient.InferInput("x", [1], "FP32")
    tensor.set_data_from_numpy(np.ones(1, np.float32))
    try:
        for model, version, request_id in (("nope", "", "g-unknown"), ("m", ".", "g-bad-version")):
            with pytest.raises(InferenceServerException):
                await asyncio.to_thread(
                    client.infer, model, [tensor], model_version=version, headers={"x-request-id": request_id}
                )
    finally:
        await asyncio.to_thread(client.close)
    records = (await get_json(http, gateway.url + "/admin/log"))["records"]
    assert [(r["request_id"], r["model"], r["status"], r["refused"], r["backend"]) for r in records] == [
        ("g-unknown", "nope", 404, True, ""),
        ("g-bad-version", "m", 400, True, ""),
    ]


async def test_the_overview_shows_every_placed_model_with_its_state_replicas_and_reason(
    sim_workers, gateways, http, scheduler
):
    (worker,) = await sim_workers(1, models=["llm"])
    gateway = await placed_gateway(gateways, scheduler, [])
    scheduler.place("llm", "ModelAvailable", [("mlserver-0", worker.url)])  # no counts: an older scheduler

    async def placed() -> bool:
        return "llm" in gateway.app[GATEWAY].clusters

    await wait_until(placed)
    overview = await get_json(http, gateway.url + "/admin/overview")
    placement = overview["placement"]
    assert (placement["scheduler"], placement["connected"], placement["synced"]) == (
        scheduler.url,
        True,
        True,
    )
    assert placement["models"] == [
        {
            "name": "chat-huge",
            "version": 1,
            "state": "ScheduleFailed",
            "reason": HUGE["reason"],
            "ready_replicas": 0,
            "desired_replicas": 1,
            "routable": False,
        },
        {
            "name": "llm",
            "version": 1,
            "state": "ModelAvailable",
            "reason": "",
            "ready_replicas": None,
            "desired_replicas": None,
            "routable": True,
        },
    ]
    assert [m["name"] for m in overview["models"]] == ["llm"]  # chat-huge has no endpoint to show
    await matches_the_document(http, gateway.url, overview, "Overview")


async def test_each_model_shows_its_own_requests_on_a_server_it_shares(sim_workers, gateways, http):
    workers = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("m", workers), model_config("echo", workers)])
    long = await http.post(gateway.url + CHAT, json=chat("long", max_tokens=5000, stream=True))
    try:
        await long.content.readline()  # m's request is running on the one server
        before = time.time()
        overview = await get_json(http, gateway.url + "/admin/overview")
        after = time.time()
    finally:
        long.close()
    assert before <= overview["now"] <= after  # the gateway's clock, which the dashboard's charts use
    endpoints = {m["name"]: m["endpoints"][0] for m in overview["models"]}
    assert (endpoints["m"]["model_in_flight"], endpoints["m"]["in_flight"]) == (1, 1)
    assert (endpoints["echo"]["model_in_flight"], endpoints["echo"]["in_flight"]) == (0, 1)
    assert overview["placement"] is None  # no scheduler followed
    await matches_the_document(http, gateway.url, overview, "Overview")
    await send(http, gateway.url, "after")
    log = await get_json(http, gateway.url + "/admin/log")
    await matches_the_document(http, gateway.url, log, "RoutingLog")


async def matches_the_document(http: aiohttp.ClientSession, url: str, answer: Any, schema: str) -> None:
    """`answer` is what the gateway's own OpenAPI document says of `schema`."""
    document = await get_json(http, url + "/openapi.json")
    root = {"$ref": f"#/components/schemas/{schema}", "components": document["components"]}
    jsonschema_rs.validator_for(root).validate(answer)
