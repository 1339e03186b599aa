"""Traffic governance end to end: routes and subsets, moving a canary, retries, timeouts, outlier
ejection and panic mode, back-pressure, resource_aware scraping and shadow traffic.

A real gateway over real sim workers, plus small aiohttp servers on port 0 for the misbehaviours
a sim worker cannot show (a 503, a stream that breaks or goes silent, a failing health check).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from modelyard.gateway import GATEWAY
from support import metric_value, model_config, sim_stats, wait_until

CHAT = "/v1/chat/completions"
FIRST_EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "one"}}]}\n\n'


def chat(content: str = "hello", *, model: str = "m", max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


def in_subsets(config: dict[str, Any], *subsets: str) -> dict[str, Any]:
    """Label the endpoints of `config`, in order, with `subsets`."""
    for endpoint, subset in zip(config["endpoints"], subsets, strict=True):
        endpoint["subset"] = subset
    return config


def split(v1: int, v2: int, **route: Any) -> dict[str, Any]:
    return {"destinations": [{"subset": "v1", "weight": v1}, {"subset": "v2", "weight": v2}], **route}


class Answer:
    def __init__(self, status: int, headers: Any, body: Any) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def subset(self) -> str:
        return self.headers["X-Modelyard-Subset"]

    @property
    def backend(self) -> str:
        return self.headers["X-Modelyard-Backend"]

    @property
    def text(self) -> str:
        return self.body["choices"][0]["message"]["content"]


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    async with http.post(url + CHAT, json=body or chat(), headers=headers or {}) as response:
        data = await response.read()
        return Answer(response.status, response.headers, orjson.loads(data) if data else None)


async def ok(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None, **headers: str
) -> Answer:
    answer = await post(http, url, body, {k.replace("_", "-"): v for k, v in headers.items()})
    assert answer.status == 200, answer.body
    return answer


async def read_stream(response: aiohttp.ClientResponse) -> tuple[bytes, bool]:
    """Everything the client received, and whether the connection was cut (not ended cleanly)."""
    received = b""
    try:
        async with asyncio.timeout(10):
            async for chunk in response.content.iter_any():
                received += chunk
    except aiohttp.ClientPayloadError:
        return received, True
    return received, False


# --- small upstream servers that misbehave in one way --------------------------------------------

Handler = Callable[[web.Request, "Upstream"], Awaitable[web.StreamResponse]]


class Upstream:
    """An OpenAI-shaped server on port 0 whose chat answer is `handler`; counts the requests."""

    def __init__(self) -> None:
        self.url = ""
        self.requests = 0
        self.release = asyncio.Event()  # lets a handler that hangs finish (set at teardown)


@pytest.fixture
async def upstreams() -> AsyncIterator[Callable[..., Awaitable[Upstream]]]:
    """`await upstreams(handler, health=200)`: `GET /health` answers `health`."""
    started: list[tuple[Upstream, web.AppRunner]] = []

    async def start(handler: Handler, *, health: int = 200) -> Upstream:
        upstream = Upstream()

        async def chat_completions(request: web.Request) -> web.StreamResponse:
            upstream.requests += 1
            await request.read()
            return await handler(request, upstream)

        async def health_check(request: web.Request) -> web.Response:
            return web.json_response({"healthy": health == 200}, status=health)

        app = web.Application()
        app.router.add_post(CHAT, chat_completions)
        app.router.add_get("/health", health_check)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True)
        await runner.setup()
        started.append((upstream, runner))
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        upstream.url = f"http://{host}:{port}"
        return upstream

    yield start
    for upstream, runner in started:
        upstream.release.set()
        await runner.cleanup()


async def unavailable(request: web.Request, upstream: Upstream) -> web.Response:
    return web.json_response({"error": {"message": "try later", "type": "server_error"}}, status=503)


def answers(text: str) -> Handler:
    async def handler(request: web.Request, upstream: Upstream) -> web.Response:
        message = {"role": "assistant", "content": text}
        return web.json_response(
            {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )

    return handler


async def one_chunk_then_break(request: web.Request, upstream: Upstream) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(FIRST_EVENT)
    assert request.transport is not None
    request.transport.abort()  # mid-stream, without the terminating chunk
    raise asyncio.CancelledError  # nothing more can be written


async def one_chunk_then_silence(request: web.Request, upstream: Upstream) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(FIRST_EVENT)
    await upstream.release.wait()  # until the gateway hangs up (cancelled) or the test ends
    return response


# --- 1. routes: matches, weights, stickiness ------------------------------------------------------


def readme_model(workers: list[Any]) -> dict[str, Any]:
    """README's example: v1 on two endpoints, v2 on one; `x-model-version: v2` pins v2; the rest
    go 90/10, sticky per `x-user-id`."""
    config = in_subsets(model_config("m", workers), "v1", "v1", "v2")
    config["routes"] = [
        {
            "name": "pinned-v2",
            "match": {"headers": [{"name": "x-model-version", "exact": "v2"}]},
            "destinations": [{"subset": "v2"}],
        },
        {"name": "canary", "hash_on": "x-user-id", **split(90, 10)},
    ]
    return config


async def test_readme_example_pins_v2_by_header_and_splits_the_rest_90_10(sim_workers, gateways, http):
    workers = await sim_workers(3)
    gateway = await gateways([readme_model(workers)], seed=1)
    pinned = [await ok(http, gateway.url, x_model_version="v2") for _ in range(10)]
    assert {(a.headers["X-Modelyard-Route"], a.subset, a.backend) for a in pinned} == {
        ("pinned-v2", "v2", "w2")
    }

    answers_: list[Answer] = []
    for _ in range(20):  # 400 requests, 20 at a time
        answers_ += await asyncio.gather(*(ok(http, gateway.url, x_model_version="v1") for _ in range(20)))
    assert {a.headers["X-Modelyard-Route"] for a in answers_} == {"canary"}
    share = sum(a.subset == "v2" for a in answers_) / len(answers_)
    assert 0.06 <= share <= 0.14
    assert {a.backend for a in answers_ if a.subset == "v1"} == {"w0", "w1"}
    assert {a.backend for a in answers_ if a.subset == "v2"} == {"w2"}
    assert (await sim_stats(http, workers[2]))["requests_total"] == 10 + sum(
        a.subset == "v2" for a in answers_
    )


async def test_hash_on_keeps_each_user_on_one_subset(sim_workers, gateways, http):
    workers = await sim_workers(3)
    config = in_subsets(model_config("m", workers), "v1", "v1", "v2")
    config["routes"] = [{"name": "canary", "hash_on": "x-user-id", **split(50, 50)}]
    gateway = await gateways([config], seed=3)
    placed: dict[str, set[str]] = {}
    for _ in range(4):
        for user in (f"user-{i}" for i in range(20)):
            placed.setdefault(user, set()).add((await ok(http, gateway.url, x_user_id=user)).subset)
    assert all(len(subsets) == 1 for subsets in placed.values()), placed
    assert set().union(*placed.values()) == {"v1", "v2"}


async def test_header_prefix_regex_model_and_body_matches(sim_workers, gateways, http):
    workers = await sim_workers(2)
    config = in_subsets(model_config("m", workers), "standard", "premium")
    to_premium = {"destinations": [{"subset": "premium"}]}
    config["routes"] = [
        {"name": "gold", "match": {"body": [{"field": "metadata.tier", "exact": "gold"}]}, **to_premium},
        {"name": "beta", "match": {"headers": [{"name": "x-client", "prefix": "beta-"}]}, **to_premium},
        {"name": "batch", "match": {"headers": [{"name": "x-job", "regex": "batch-[0-9]+"}]}, **to_premium},
        {"name": "other-model", "match": {"model": "not-m"}, **to_premium},
        {"name": "model-m", "match": {"model": "m"}, "destinations": [{"subset": "standard"}]},
    ]
    gateway = await gateways([config])

    async def route_of(body: dict[str, Any] | None = None, **headers: str) -> tuple[str, str]:
        answer = await ok(http, gateway.url, body, **headers)
        return answer.headers["X-Modelyard-Route"], answer.subset

    assert await route_of(chat(metadata={"tier": "gold"})) == ("gold", "premium")
    assert await route_of(chat(metadata={"tier": "silver"})) == ("model-m", "standard")
    assert await route_of(chat(tier="gold")) == (
        "model-m",
        "standard",
    )  # a top-level field is not metadata.tier
    assert await route_of(X_Client="beta-ios") == ("beta", "premium")  # header names are case-insensitive
    assert await route_of(x_client="ios-beta") == ("model-m", "standard")
    assert await route_of(x_job="batch-42") == ("batch", "premium")
    assert await route_of(x_job="batch-42x") == ("model-m", "standard")  # regex is a full match
    assert await route_of() == ("model-m", "standard")


async def test_no_matching_route_and_no_default_is_404_naming_the_routes(sim_workers, gateways, http):
    workers = await sim_workers(2)
    config = in_subsets(model_config("m", workers), "v1", "v2")
    config["routes"] = [
        {
            "name": "pinned-v2",
            "match": {"headers": [{"name": "x-model-version", "exact": "v2"}]},
            **split(0, 1),
        },
        {"name": "beta", "match": {"headers": [{"name": "x-client", "prefix": "beta-"}]}, **split(1, 0)},
    ]
    gateway = await gateways([config])
    answer = await post(http, gateway.url, chat(), {"x-model-version": "v3"})
    assert answer.status == 404
    assert answer.body["error"]["type"] == "not_found_error"
    assert "pinned-v2" in answer.body["error"]["message"] and "beta" in answer.body["error"]["message"]
    assert [(await sim_stats(http, w))["requests_total"] for w in workers] == [0, 0]


# --- 2. moving a canary at runtime ---------------------------------------------------------------


async def put_routes(http: aiohttp.ClientSession, url: str, routes: Any) -> tuple[int, dict[str, Any]]:
    async with http.put(url + "/admin/models/m/routes", json={"routes": routes}) as response:
        return response.status, await response.json()


async def test_canary_moves_10_50_100_under_load_without_a_failed_request(sim_workers, gateways, http):
    workers = await sim_workers(3, decode_ms_per_token=1.0)
    config = in_subsets(model_config("m", workers), "v1", "v1", "v2")
    config["routes"] = [{"name": "canary", **split(90, 10)}]
    gateway = await gateways([config])
    phase = 10  # the canary weight in force when a request starts
    results: list[tuple[int, int, str | None]] = []

    async def client() -> None:
        for _ in range(100):
            started_in = phase
            async with http.post(gateway.url + CHAT, json=chat(max_tokens=3)) as response:
                await response.read()
                results.append((started_in, response.status, response.headers.get("X-Modelyard-Subset")))

    def done(count: int) -> Callable[[], Awaitable[bool]]:
        async def reached() -> bool:
            return len(results) >= count

        return reached

    load = [asyncio.create_task(client()) for _ in range(3)]
    try:
        for weight, after in ((50, 60), (100, 150)):
            await wait_until(done(after), interval=0.002, attempts=5000)
            status, view = await put_routes(
                http, gateway.url, [{"name": "canary", **split(100 - weight, weight)}]
            )
            assert status == 200, view
            phase = weight
            assert len(results) < 300, "the load ended before the canary moved"
        await asyncio.gather(*load)
    finally:
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)

    assert len(results) == 300
    assert {status for _, status, _ in results} == {200}
    assert {subset for started_in, _, subset in results if started_in == 50} == {"v1", "v2"}
    assert {subset for started_in, _, subset in results if started_in == 100} == {"v2"}
    assert {(await ok(http, gateway.url)).subset for _ in range(20)} == {"v2"}
    async with http.get(gateway.url + "/admin/models/m/routes") as response:
        view = await response.json()
    assert view["routes"][0]["destinations"] == [{"subset": "v1", "weight": 0}, {"subset": "v2"}]


async def test_invalid_routes_are_refused_with_every_problem_and_the_old_ones_serve(
    sim_workers, gateways, http
):
    workers = await sim_workers(2)
    config = in_subsets(model_config("m", workers), "v1", "v2")
    config["routes"] = [{"name": "canary", **split(100, 0)}]
    gateway = await gateways([config])

    status, body = await put_routes(
        http, gateway.url, [{"name": "canary", **split(50, 0), "mirror": {"subset": "v3"}}]
    )
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert any("'v3'" in problem for problem in body["error"]["problems"]), body

    bad_regex = {"name": "r", "match": {"headers": [{"name": "x", "regex": "("}]}, **split(1, 1)}
    status, body = await put_routes(http, gateway.url, [bad_regex, {"name": "canary", **split(0, 1)}])
    assert status == 400
    problems = body["error"]["problems"]
    assert any("routes[0].match.headers[0]" in p and "regex" in p for p in problems), problems

    async with http.get(gateway.url + "/admin/models/m/routes") as response:
        view = await response.json()
    assert [r["name"] for r in view["routes"]] == ["canary"] and view["subsets"] == ["v1", "v2"]
    served = [await ok(http, gateway.url) for _ in range(5)]
    assert {(a.headers["X-Modelyard-Route"], a.subset) for a in served} == {("canary", "v1")}


async def test_a_routes_update_reports_every_problem_at_once(sim_workers, gateways, http):
    workers = await sim_workers(2)
    gateway = await gateways([in_subsets(model_config("m", workers), "v1", "v2")])
    bad_regex = {"name": "r", "match": {"headers": [{"name": "x", "regex": "("}]}, **split(1, 1)}
    status, body = await put_routes(
        http, gateway.url, [bad_regex, {"name": "canary", "destinations": [{"subset": "v9"}]}]
    )
    assert status == 400
    problems = body["error"]["problems"]
    assert any("regex" in p for p in problems) and any("'v9'" in p for p in problems), problems


# --- 3. retries ----------------------------------------------------------------------------------


async def retries(http: aiohttp.ClientSession, url: str, reason: str, route: str = "default") -> float:
    return await metric_value(http, url, "modelyard_retries_total", model="m", route=route, reason=reason)


async def test_a_refused_connection_is_retried_on_another_endpoint(sim_workers, gateways, http):
    workers = await sim_workers(2)
    gateway = await gateways([model_config("m", workers)])
    await workers[0].stop()  # round robin sends the first request to w0
    answer = await ok(http, gateway.url)
    assert answer.backend == "w1"
    assert await retries(http, gateway.url, "connect-failure") == 1


async def test_a_503_is_retried_on_another_endpoint(sim_workers, upstreams, gateways, http):
    failing = await upstreams(unavailable)
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [failing, worker])])
    answer = await ok(http, gateway.url)
    assert answer.backend == "w1"
    assert failing.requests == 1
    assert await retries(http, gateway.url, "gateway-error") == 1


async def test_with_no_retries_the_503_is_relayed(sim_workers, upstreams, gateways, http):
    failing = await upstreams(unavailable)
    (worker,) = await sim_workers(1)
    config = model_config("m", [failing, worker])
    config["routes"] = [{"name": "once", "destinations": [{"subset": "default"}], "retries": {"attempts": 0}}]
    gateway = await gateways([config])
    answer = await post(http, gateway.url)
    assert answer.status == 503 and answer.backend == "w0"
    assert answer.body == {"error": {"message": "try later", "type": "server_error"}}
    assert failing.requests == 1 and (await sim_stats(http, worker))["requests_total"] == 0
    assert await retries(http, gateway.url, "gateway-error", route="once") == 0


async def test_a_relayed_503_is_counted_once(upstreams, gateways, http):
    failing = await upstreams(unavailable)
    config = model_config("m", [failing])
    config["routes"] = [{"name": "once", "destinations": [{"subset": "default"}], "retries": {"attempts": 0}}]
    gateway = await gateways([config])
    assert (await post(http, gateway.url)).status == 503
    assert await metric_value(http, gateway.url, "modelyard_requests_total", backend="w0", code="503") == 1


def final_error(received: bytes) -> dict[str, Any]:
    """The stream as received is the first event, then one final event carrying an error."""
    assert received.startswith(FIRST_EVENT)
    rest = received[len(FIRST_EVENT) :]
    assert rest.startswith(b"data: ") and rest.endswith(b"\n\n") and rest.count(b"\n\n") == 1, rest
    error = orjson.loads(rest[len(b"data: ") :])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_a_stream_is_not_retried_after_its_first_byte(sim_workers, upstreams, gateways, http):
    broken = await upstreams(one_chunk_then_break)
    (spare,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [broken, spare])])
    async with http.post(gateway.url + CHAT, json=chat(stream=True)) as response:
        assert response.status == 200 and response.headers["X-Modelyard-Backend"] == "w0"
        received, _cut = await read_stream(response)
    final_error(received)  # the first chunk, the error, and no [DONE]
    assert broken.requests == 1
    assert (await sim_stats(http, spare))["requests_total"] == 0
    assert await metric_value(http, gateway.url, "modelyard_retries_total") == 0


async def test_a_stream_broken_upstream_ends_with_an_error_event(upstreams, gateways, http):
    broken = await upstreams(one_chunk_then_break)
    gateway = await gateways([model_config("m", [broken])])
    async with http.post(gateway.url + CHAT, json=chat(stream=True)) as response:
        received, cut = await read_stream(response)
    error = final_error(received)
    assert error["type"] == "upstream_error" and "closed the connection" in error["message"]
    assert not cut  # a well-formed chunked body: the error event says the answer is incomplete
    errors = "modelyard_stream_errors_total"
    assert await metric_value(http, gateway.url, errors, model="m", code="bad_gateway") == 1
    assert await metric_value(http, gateway.url, "modelyard_requests_total", code="502") == 1


async def test_a_spent_retry_budget_relays_the_failure(sim_workers, upstreams, gateways, http):
    failing = await upstreams(unavailable)
    (worker,) = await sim_workers(1)
    budget = {"budget_percent": 0, "min_retry_concurrency": 0}
    gateway = await gateways([model_config("m", [failing, worker], retry_budget=budget)])
    answer = await post(http, gateway.url)
    assert answer.status == 503 and answer.backend == "w0"
    assert (await sim_stats(http, worker))["requests_total"] == 0
    exhausted = "modelyard_retry_budget_exhausted_total"
    assert await metric_value(http, gateway.url, exhausted, model="m", route="default") == 1
    assert await metric_value(http, gateway.url, "modelyard_retries_total") == 0


# --- 4. timeouts ---------------------------------------------------------------------------------


def only_route(**fields: Any) -> list[dict[str, Any]]:
    return [{"name": "r", "destinations": [{"subset": "default"}], **fields}]


async def test_per_try_timeout_retries_a_slow_endpoint_on_a_fast_one(sim_workers, gateways, http):
    (slow,) = await sim_workers(1, decode_ms_per_token=1000.0)  # 4 tokens: 4 s
    (fast,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [slow, fast], routes=only_route(per_try_timeout="200ms"))])
    answer = await ok(http, gateway.url)
    assert answer.backend == "w1"
    assert slow.stats.requests_total == 1
    assert await retries(http, gateway.url, "gateway-error", route="r") == 1


async def test_route_timeout_answers_504(sim_workers, gateways, http):
    (slow,) = await sim_workers(1, decode_ms_per_token=1000.0)
    gateway = await gateways([model_config("m", [slow], routes=only_route(timeout="200ms"))])
    started = time.monotonic()
    answer = await post(http, gateway.url)
    assert time.monotonic() - started < 3.0  # well before the 4 s answer
    assert answer.status == 504
    assert answer.body["error"]["code"] == "upstream_timeout"
    assert "'r'" in answer.body["error"]["message"]


async def test_stream_idle_timeout_ends_a_silent_stream_with_an_error_event(upstreams, gateways, http):
    silent = await upstreams(one_chunk_then_silence)
    gateway = await gateways([model_config("m", [silent], routes=only_route(stream_idle_timeout="200ms"))])
    async with http.post(gateway.url + CHAT, json=chat(stream=True)) as response:
        assert response.status == 200
        received, cut = await read_stream(response)
    assert final_error(received)["code"] == "upstream_timeout"  # and no [DONE]
    assert not cut
    assert await metric_value(http, gateway.url, "modelyard_stream_idle_timeouts_total", model="m") == 1
    errors = "modelyard_stream_errors_total"
    assert await metric_value(http, gateway.url, errors, model="m", code="upstream_timeout") == 1


# --- 5. outlier detection and panic mode ---------------------------------------------------------


async def outlier_events(
    http: aiohttp.ClientSession, url: str, event: str, backend: str | None = None
) -> float:
    labels = {"model": "m", "event": event} | ({"backend": backend} if backend is not None else {})
    return await metric_value(http, url, "modelyard_outlier_events_total", **labels)


async def test_consecutive_5xx_ejects_the_endpoint(sim_workers, upstreams, gateways, http):
    failing = await upstreams(unavailable)
    workers = await sim_workers(2)
    detection = {"consecutive_5xx": 3, "base_ejection_time": "30s"}
    gateway = await gateways([model_config("m", [failing, *workers], outlier_detection=detection)])
    # Round robin tries w0 every third request; the 503s are retried, so no client sees them.
    for _ in range(9):
        await ok(http, gateway.url)
    assert failing.requests == 3
    assert await outlier_events(http, gateway.url, "consecutive_5xx", "w0") == 1
    later = [await ok(http, gateway.url) for _ in range(9)]
    assert {a.backend for a in later} == {"w1", "w2"}
    assert failing.requests == 3


async def test_an_ejected_endpoint_returns_after_base_ejection_time(sim_workers, upstreams, gateways, http):
    failing = await upstreams(unavailable)
    workers = await sim_workers(2)
    detection = {"consecutive_5xx": 3, "base_ejection_time": "200ms"}
    gateway = await gateways([model_config("m", [failing, *workers], outlier_detection=detection)])
    for _ in range(9):
        await ok(http, gateway.url)
    assert await outlier_events(http, gateway.url, "consecutive_5xx", "w0") == 1
    ejected_at = time.monotonic()

    async def returned() -> bool:
        await ok(http, gateway.url)  # returns are applied as requests are routed
        return await outlier_events(http, gateway.url, "returned", "w0") == 1

    await wait_until(returned, attempts=200)
    assert time.monotonic() - ejected_at >= 0.15
    before = failing.requests
    for _ in range(3):
        await ok(http, gateway.url)
    assert failing.requests > before  # back in the rotation


async def test_max_ejection_percent_caps_ejections(upstreams, sim_workers, gateways, http):
    first, second = await upstreams(unavailable), await upstreams(unavailable)
    (worker,) = await sim_workers(1)
    detection = {"consecutive_5xx": 3, "base_ejection_time": "30s", "max_ejection_percent": 34}
    gateway = await gateways([model_config("m", [first, second, worker], outlier_detection=detection)])
    for _ in range(15):
        await ok(http, gateway.url)  # two retries reach w2 whatever the first two tries hit
    assert await outlier_events(http, gateway.url, "consecutive_5xx") == 1
    counts = (first.requests, second.requests)
    for _ in range(9):
        await ok(http, gateway.url)
    # One of the failing endpoints is out; the other still takes traffic, and is not ejected.
    gained = sorted((first.requests - counts[0], second.requests - counts[1]))
    assert gained[0] == 0 and gained[1] > 0
    assert await outlier_events(http, gateway.url, "consecutive_5xx") == 1
    assert await outlier_events(http, gateway.url, "panic") == 0


async def test_a_slow_endpoint_is_ejected_for_latency(sim_workers, gateways, http):
    (slow,) = await sim_workers(1, decode_ms_per_token=40.0)  # 4 tokens: 160 ms
    fast = await sim_workers(2, decode_ms_per_token=2.0)  # 8 ms
    detection = {"latency_min_requests": 5, "latency_factor": 3, "base_ejection_time": "30s"}
    gateway = await gateways([model_config("m", [slow, *fast], outlier_detection=detection)])

    async def ejected() -> bool:
        await asyncio.gather(*(ok(http, gateway.url) for _ in range(12)))
        return await outlier_events(http, gateway.url, "latency", "w0") == 1

    await wait_until(ejected, attempts=10, interval=0)
    assert await outlier_events(http, gateway.url, "latency") == 1  # only the slow one
    later = await asyncio.gather(*(ok(http, gateway.url) for _ in range(9)))
    assert {a.backend for a in later} == {"w1", "w2"}


async def test_latency_is_judged_with_fewer_than_16_answers_in_the_window(sim_workers, gateways, http):
    (slow,) = await sim_workers(1, decode_ms_per_token=40.0)
    fast = await sim_workers(2, decode_ms_per_token=2.0)
    detection = {"latency_min_requests": 3, "latency_factor": 3, "latency_window": "1s"}
    gateway = await gateways([model_config("m", [slow, *fast], outlier_detection=detection)])
    for _ in range(24):  # eight rounds of ~0.18 s: about 5 answers per endpoint in any 1 s window
        await ok(http, gateway.url)
    assert await outlier_events(http, gateway.url, "latency", "w0") == 1


@pytest.mark.parametrize(("threshold", "spread"), [(80, {"w0", "w1", "w2"}), (0, {"w0"})])
async def test_panic_threshold_spreads_traffic_over_the_whole_pool(
    threshold, spread, sim_workers, upstreams, gateways, http
):
    (worker,) = await sim_workers(1)
    down = [await upstreams(answers("still here"), health=503) for _ in range(2)]
    config = model_config("m", [worker, *down], healthy_panic_threshold=threshold)
    gateway = await gateways([config])
    backends = {(await ok(http, gateway.url)).backend for _ in range(9)}
    assert backends == spread
    assert await outlier_events(http, gateway.url, "panic") == (1 if threshold else 0)


async def test_panic_in_one_subset_is_counted_once(sim_workers, upstreams, gateways, http):
    workers = await sim_workers(2)
    down = await upstreams(answers("still here"), health=503)
    config = in_subsets(
        model_config("m", [workers[0], down, workers[1]], healthy_panic_threshold=80), "v1", "v1", "v2"
    )
    config["routes"] = [
        {
            "name": "pinned-v2",
            "match": {"headers": [{"name": "x-model-version", "exact": "v2"}]},
            **split(0, 1),
        },
        {"name": "main", **split(1, 0)},
    ]
    gateway = await gateways([config])
    for _ in range(4):
        assert (await ok(http, gateway.url)).subset == "v1"
        assert (await ok(http, gateway.url, x_model_version="v2")).subset == "v2"
    assert await outlier_events(http, gateway.url, "panic") == 1


# --- 6. back-pressure ----------------------------------------------------------------------------


async def test_back_pressure_queues_one_and_refuses_the_rest_at_once(sim_workers, gateways, http):
    (worker,) = await sim_workers(1, decode_ms_per_token=20.0)
    breakers = {"max_requests": 1, "max_pending_requests": 1, "queue_timeout": "10s"}
    gateway = await gateways([model_config("m", [worker], circuit_breakers=breakers)])
    first = await http.post(gateway.url + CHAT, json=chat("long", max_tokens=100_000, stream=True))
    try:
        assert first.status == 200
        await first.content.readline()  # the first runs
        others = [asyncio.create_task(post(http, gateway.url, chat(max_tokens=1))) for _ in range(4)]

        async def refused() -> bool:
            return sum(task.done() for task in others) >= 3

        await wait_until(refused)  # while the first still runs (it would take half an hour)
        assert (await sim_stats(http, worker))["running"] == 1
        done_tasks = [task for task in others if task.done()]
        assert len(done_tasks) == 3
        for answer in (task.result() for task in done_tasks):
            assert answer.status == 429
            assert answer.headers["Retry-After"] == "1"
            assert answer.body["error"]["type"] == "rate_limit_error"
            assert answer.body["error"]["code"] == "overloaded"
            assert "already wait" in answer.body["error"]["message"]  # the queue was full, no wait
    finally:
        first.close()  # the first finishes: the waiting request goes
    (waiting,) = [task for task in others if task not in done_tasks]
    answer = await asyncio.wait_for(waiting, 10)
    assert answer.status == 200 and answer.backend == "w0"
    assert await metric_value(http, gateway.url, "modelyard_overloaded_total", model="m") == 3


async def test_a_queued_request_gets_429_after_queue_timeout(sim_workers, gateways, http):
    (worker,) = await sim_workers(1, decode_ms_per_token=20.0)
    breakers = {"max_requests": 1, "max_pending_requests": 1, "queue_timeout": "200ms"}
    gateway = await gateways([model_config("m", [worker], circuit_breakers=breakers)])
    first = await http.post(gateway.url + CHAT, json=chat("long", max_tokens=100_000, stream=True))
    try:
        await first.content.readline()
        started = time.monotonic()
        answer = await post(http, gateway.url, chat(max_tokens=1))
        waited = time.monotonic() - started
    finally:
        first.close()
    assert answer.status == 429 and answer.headers["Retry-After"] == "1"
    assert "0.2s" in answer.body["error"]["message"]
    assert 0.15 <= waited < 5
    assert await metric_value(http, gateway.url, "modelyard_overloaded_total", model="m") == 1


# --- 7. resource_aware ---------------------------------------------------------------------------


async def keep_busy(http: aiohttp.ClientSession, worker: Any, count: int) -> list[asyncio.Task[None]]:
    """`count` long completions sent straight to `worker` (one slot): one runs, the rest queue."""

    async def long_request() -> None:
        body = {"model": "sim-model", "prompt": "busy", "max_tokens": 2000}
        async with http.post(worker.url + "/v1/completions", json=body) as response:
            await response.read()

    tasks = [asyncio.create_task(long_request()) for _ in range(count)]

    async def queued() -> bool:
        return worker.stats.waiting == count - 1

    await wait_until(queued)
    return tasks


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def scraped_queue(gateway: Any, index: int, depth: int) -> Callable[[], Awaitable[bool]]:
    endpoint = gateway.app[GATEWAY].clusters["m"].endpoints[index]

    async def seen() -> bool:
        return endpoint.resources is not None and endpoint.resources.queue_depth == depth

    return seen


async def test_resource_aware_sends_new_requests_to_the_idle_worker(sim_workers, gateways, http):
    busy, idle = await sim_workers(2, max_concurrency=1, decode_ms_per_token=20.0)
    config = model_config(
        "m", [busy, idle], strategy="resource_aware", resource_aware={"scrape_interval": "100ms"}
    )
    gateway = await gateways([config])
    tasks = await keep_busy(http, busy, 4)
    try:
        await wait_until(scraped_queue(gateway, 0, 3))  # a later scrape sees the queue
        picks = [(await ok(http, gateway.url, chat(max_tokens=1))).backend for _ in range(8)]
    finally:
        await stop(tasks)
    assert picks == ["w1"] * 8


async def test_switching_to_resource_aware_at_runtime_starts_scraping(sim_workers, gateways, http):
    busy, idle = await sim_workers(2, max_concurrency=1, decode_ms_per_token=20.0)
    config = model_config("m", [busy, idle], resource_aware={"scrape_interval": "100ms"})
    gateway = await gateways([config])
    endpoints = gateway.app[GATEWAY].clusters["m"].endpoints
    assert [e.resources for e in endpoints] == [None, None]  # round_robin: nothing scraped
    async with http.put(gateway.url + "/admin/strategy", json={"strategy": "resource_aware"}) as response:
        assert response.status == 200
        assert (await response.json())["models"] == {"m": "resource_aware"}

    async def scraped() -> bool:
        return all(e.resources is not None for e in endpoints)

    await wait_until(scraped)  # the switch started the scraper; its first scrape follows at once
    tasks = await keep_busy(http, busy, 4)
    try:
        await wait_until(scraped_queue(gateway, 0, 3))
        answer = await ok(http, gateway.url, chat(max_tokens=1))
    finally:
        await stop(tasks)
    assert answer.backend == "w1" and answer.headers["X-Modelyard-Strategy"] == "resource_aware"


# --- 8. shadow traffic ---------------------------------------------------------------------------


def mirrored_model(primary: Any, canary: Any) -> dict[str, Any]:
    config = in_subsets(model_config("m", [primary, canary]), "v1", "v2")
    config["routes"] = [{"name": "shadowed", **split(1, 0), "mirror": {"subset": "v2", "percent": 100}}]
    return config


async def canary_view(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/models/m/canary") as response:
        assert response.status == 200
        return await response.json()


async def wait_for_shadows(http: aiohttp.ClientSession, url: str, count: int) -> dict[str, Any]:
    async def all_recorded() -> bool:
        summary = (await canary_view(http, url))["routes"].get("shadowed")
        return summary is not None and summary["subsets"].get("v2", {}).get("requests") == count

    await wait_until(all_recorded)
    return await canary_view(http, url)


async def test_shadow_traffic_compares_a_canary_that_answers_differently(sim_workers, gateways, http):
    (primary,) = await sim_workers(1)
    (canary,) = await sim_workers(1, answer_variant=1)
    (reference,) = await sim_workers(1)  # not in the gateway: what the primary alone would answer
    gateway = await gateways([mirrored_model(primary, canary)])
    prompts = [f"question {i}" for i in range(10)]
    answers_ = [await ok(http, gateway.url, chat(p, max_tokens=8)) for p in prompts]
    assert {(a.headers["X-Modelyard-Route"], a.subset, a.backend) for a in answers_} == {
        ("shadowed", "v1", "w0")
    }
    expected = [(await ok(http, reference.url, chat(p, max_tokens=8))).text for p in prompts]
    assert [a.text for a in answers_] == expected

    view = await wait_for_shadows(http, gateway.url, 10)
    assert (await sim_stats(http, canary))["requests_total"] == 10
    assert view["mirrors"] == {"shadowed": {"subset": "v2", "percent": 100.0}}
    summary = view["routes"]["shadowed"]
    assert summary["compared"] == 10
    assert summary["mean_rouge_l"] < 1 and summary["exact_match_rate"] < 1
    for subset in ("v1", "v2"):
        stats = summary["subsets"][subset]
        assert stats["requests"] == 10 and stats["errors"] == 0 and stats["error_rate"] == 0.0
        assert stats["p50_ms"] > 0 and stats["p95_ms"] >= stats["p50_ms"]
    agreement = await metric_value(
        http, gateway.url, "modelyard_canary_agreement", model="m", route="shadowed"
    )
    assert agreement == pytest.approx(summary["mean_rouge_l"])
    mirrored_ok = await metric_value(
        http, gateway.url, "modelyard_canary_requests_total", route="shadowed", subset="v2", result="ok"
    )
    assert mirrored_ok == 10


async def test_an_identical_canary_agrees_fully_streamed_or_not(sim_workers, gateways, http):
    primary, canary = await sim_workers(2)
    gateway = await gateways([mirrored_model(primary, canary)])
    for i in range(3):
        await ok(http, gateway.url, chat(f"question {i}", max_tokens=8))
    for i in range(3):
        async with http.post(
            gateway.url + CHAT, json=chat(f"stream {i}", max_tokens=8, stream=True)
        ) as response:
            assert response.headers["X-Modelyard-Subset"] == "v1"
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
    summary = (await wait_for_shadows(http, gateway.url, 6))["routes"]["shadowed"]
    assert summary["compared"] == 6
    assert summary["mean_rouge_l"] == 1.0 and summary["exact_match_rate"] == 1.0
    assert (await sim_stats(http, canary))["requests_total"] == 6


async def test_a_failing_mirror_never_fails_the_request(sim_workers, gateways, http):
    primary, canary = await sim_workers(2)
    gateway = await gateways([mirrored_model(primary, canary)])
    await canary.stop()
    answers_ = [await ok(http, gateway.url, chat(f"question {i}")) for i in range(5)]
    assert {a.backend for a in answers_} == {"w0"}
    summary = (await wait_for_shadows(http, gateway.url, 5))["routes"]["shadowed"]
    assert summary["compared"] == 0 and summary["mean_rouge_l"] is None
    assert summary["subsets"]["v2"]["error_rate"] == 1.0
    assert summary["subsets"]["v1"]["error_rate"] == 0.0


async def test_a_full_model_refuses_an_oip_request_before_reading_its_body(sim_workers, gateways, http):
    # OIP names the model in the path, so the gateway can refuse at once, body unread.
    (worker,) = await sim_workers(1, decode_ms_per_token=3000.0, models=["m"])
    config = model_config("m", [worker], circuit_breakers={"max_requests": 1, "max_pending_requests": 0})
    gateway = await gateways([config])
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    first = asyncio.create_task(http.post(gateway.url + "/v2/models/m/infer", json=body))

    async def running() -> bool:
        return (await sim_stats(http, worker))["running"] == 1

    await wait_until(running)
    async with http.post(gateway.url + "/v2/models/m/infer", json=body) as response:
        assert response.status == 429
        assert response.headers["Retry-After"] == "1"
        assert "at capacity" in (await response.json())["error"]
    assert await metric_value(http, gateway.url, "modelyard_overloaded_total", model="m") == 1
    first.cancel()


# --- regressions found in review ---------------------------------------------------------------


async def two_subsets_of_one(sim_workers: Any, gateways: Any) -> tuple[Any, Any, Any]:
    """Subsets a and b, one slow worker each, one request in flight per endpoint, a wait queue;
    `x-sub: b` routes to b, everything else to a."""
    a, b = await sim_workers(2, decode_ms_per_token=20.0)
    config = in_subsets(model_config("m", [a, b]), "a", "b")
    config["routes"] = [
        {
            "name": "to-b",
            "match": {"headers": [{"name": "x-sub", "exact": "b"}]},
            "destinations": [{"subset": "b"}],
        },
        {"name": "to-a", "destinations": [{"subset": "a"}]},
    ]
    config["circuit_breakers"] = {"max_requests": 1, "max_pending_requests": 4, "queue_timeout": "5s"}
    return await gateways([config]), a, b


async def test_a_freed_endpoint_wakes_a_waiter_of_its_own_subset(sim_workers, gateways, http):
    # Subsets a and b, one endpoint each, one request each at a time. A waiter for `a` stands
    # first in the queue; when b frees up, the waiter for b must get it, not time out behind a's.
    gateway, a, b = await two_subsets_of_one(sim_workers, gateways)
    hold_a = asyncio.create_task(http.post(gateway.url + CHAT, json=chat(max_tokens=5000)))
    b_short = asyncio.create_task(post(http, gateway.url, chat(max_tokens=10), {"x-sub": "b"}))

    async def both_running() -> bool:
        return (await sim_stats(http, a))["running"] == 1 and (await sim_stats(http, b))["running"] == 1

    await wait_until(both_running)
    wait_a = asyncio.create_task(post(http, gateway.url, chat(max_tokens=1)))  # queued first, for a
    wait_b = asyncio.create_task(post(http, gateway.url, chat(max_tokens=1), {"x-sub": "b"}))
    try:
        assert (await b_short).status == 200
        answer = await asyncio.wait_for(wait_b, 5)  # served when b frees, ahead of a's waiter
        assert answer.status == 200 and answer.backend == "w1"
        assert not wait_a.done()  # a is still busy: its waiter still waits
    finally:
        hold_a.cancel()
        wait_a.cancel()
        await asyncio.gather(hold_a, wait_a, return_exceptions=True)


async def test_the_retry_budget_counts_retries_in_flight(upstreams, gateways, http):
    # A retried try that is still talking to an upstream holds its place in the budget: with room
    # for one retry at a time, a second failure while the first retry runs is not retried.
    release = asyncio.Event()

    async def slow_unavailable(request: web.Request, upstream: Upstream) -> web.Response:
        async with asyncio.timeout(10):
            await release.wait()
        return web.json_response({"error": {"message": "later"}}, status=503)

    failing = await upstreams(unavailable)
    slow = await upstreams(slow_unavailable)
    config = {
        "name": "m",
        # weight 0: first tries always go to "fails"; retries go to the endpoint not tried, "slow".
        "endpoints": [{"name": "fails", "url": failing.url}, {"name": "slow", "url": slow.url, "weight": 0}],
        "health_check": {"interval": "60s"},
        "retry_budget": {"budget_percent": 0, "min_retry_concurrency": 1},
        "outlier_detection": {"enabled": False},
        "routes": [{"name": "r", "destinations": [{"subset": "default"}], "retries": {"attempts": 1}}],
    }
    gateway = await gateways([config])
    first = asyncio.create_task(post(http, gateway.url))
    try:

        async def retry_in_flight() -> bool:
            return slow.requests == 1

        await wait_until(retry_in_flight)
        second = await post(http, gateway.url)  # fails at once; its retry would exceed the budget
        assert second.status == 503
        assert slow.requests == 1
        labels = {"model": "m", "route": "r"}
        assert await metric_value(http, gateway.url, "modelyard_retry_budget_exhausted_total", **labels) == 1
    finally:
        release.set()
        await first


async def test_a_client_leaving_during_the_affinity_write_frees_the_endpoint_and_is_logged_once(
    sim_workers, http
):
    from modelyard.config import validate_config
    from modelyard.gateway import start_gateway
    from modelyard.state import MemoryState

    class SlowState(MemoryState):
        async def set(self, key: str, value: str, ttl: float) -> None:
            await asyncio.sleep(0.5)  # a slow shared store; the client gives up before it answers
            await super().set(key, value, ttl)

    (worker,) = await sim_workers(1)
    config = validate_config(
        {"listen": {"port": 0}, "models": [model_config("m", [worker], strategy="kv_aware")]}, "<test>"
    )
    gateway = await start_gateway(config, state=SlowState())
    try:
        with pytest.raises(asyncio.TimeoutError):
            async with asyncio.timeout(0.1):
                await http.post(gateway.url + CHAT, json=chat())

        async def freed() -> bool:
            return await metric_value(http, gateway.url, "modelyard_backend_in_flight", backend="w0") == 0

        await wait_until(freed)
        async with http.get(gateway.url + "/admin/log") as response:
            records = (await response.json())["records"]
        assert [(r["backend"], r["status"]) for r in records] == [("w0", 499)]  # closed once, as a 499
    finally:
        await gateway.stop()


async def test_a_gzip_request_body_reaches_the_server_decoded_and_labelled_so(upstreams, gateways, http):
    import gzip

    seen: list[tuple[str | None, bytes]] = []

    async def record(request: web.Request, upstream: Upstream) -> web.Response:
        seen.append((request.headers.get("Content-Encoding"), await request.read()))
        return await answers("fine")(request, upstream)

    upstream = await upstreams(record)
    gateway = await gateways(
        [{"name": "m", "endpoints": [{"url": upstream.url}], "health_check": {"interval": 0}}]
    )
    body = orjson.dumps(chat())
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with http.post(gateway.url + CHAT, data=gzip.compress(body), headers=headers) as response:
        assert response.status == 200
    assert seen == [(None, body)]


async def test_newcomers_queue_behind_waiters_of_their_subset_only(sim_workers, gateways, http):
    # a is full and has a waiter; a request for b, which has room, is served at once.
    gateway, a, _b = await two_subsets_of_one(sim_workers, gateways)
    hold_a = asyncio.create_task(http.post(gateway.url + CHAT, json=chat(max_tokens=5000)))

    async def a_running() -> bool:
        return (await sim_stats(http, a))["running"] == 1

    await wait_until(a_running)
    wait_a = asyncio.create_task(post(http, gateway.url, chat(max_tokens=1)))

    async def a_waiter_queued() -> bool:
        return gateway.app[GATEWAY].clusters["m"].capacity.queued_for("a")

    await wait_until(a_waiter_queued)
    try:
        answer = await asyncio.wait_for(post(http, gateway.url, chat(max_tokens=1), {"x-sub": "b"}), 2)
        assert answer.status == 200 and answer.backend == "w1"
    finally:
        hold_a.cancel()
        wait_a.cancel()
        await asyncio.gather(hold_a, wait_a, return_exceptions=True)
