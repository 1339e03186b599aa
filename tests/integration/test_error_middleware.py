"""One error middleware (`serving/errors.py`) answers for the gateway, the scheduler's REST API and
the agent's data plane: aiohttp's own 404, 405 (with Allow) and 413, each in the service's envelope,
and a bug as a 500 that names the service's log. The sim worker keeps aiohttp's answers outside its
routes, and its routes' refusals keep the shapes of the servers it imitates."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from modelyard.errors import NotFound
from modelyard.scheduler import RunningScheduler, SchedulerConfig, start_scheduler
from modelyard.serving.errors import REQUEST_ID, ServiceErrors
from modelyard.types import Protocol
from support import model_config

LIMIT = 1024


async def chunks() -> AsyncIterator[bytes]:
    """A chunked body over LIMIT: aiohttp's reader refuses it (no Content-Length to check first)."""
    for _ in range(4):
        yield b" " * 500


def openai_error(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def oip_error(body: dict[str, Any]) -> str:
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return body["error"]


async def answer(response: aiohttp.ClientResponse) -> tuple[int, dict[str, Any]]:
    assert response.headers["Content-Type"] == "application/json"
    return response.status, await response.json()


@pytest.fixture
async def real_scheduler() -> AsyncIterator[RunningScheduler]:
    running = await start_scheduler(
        SchedulerConfig(port=0, agent_port=0, db=":memory:", max_body_bytes=LIMIT, retry_interval=60)
    )
    yield running
    await running.stop()


async def test_gateway(sim_workers, gateways, http):
    workers = await sim_workers(1)
    gateway = await gateways([model_config("alpha", workers)], limits={"max_body_bytes": LIMIT})
    async with http.get(gateway.url + "/v1/nothing", headers={"X-Request-Id": "r-1"}) as response:
        status, body = await answer(response)
        assert response.headers["X-Request-Id"] == "r-1"  # the gateway echoes the request's id
    assert status == 404
    assert openai_error(body) == {
        "message": "no route for GET /v1/nothing",
        "type": "not_found_error",
        "param": None,
        "code": "not_found",
    }
    async with http.get(gateway.url + "/v2/nothing") as response:
        assert await answer(response) == (404, {"error": "no route for GET /v2/nothing"})
    async with http.delete(gateway.url + "/v2/models/alpha/infer") as response:
        assert await answer(response) == (
            405,
            {"error": "method DELETE is not allowed on /v2/models/alpha/infer; allowed: POST"},
        )
        assert response.headers["Allow"] == "POST"
    async with http.post(gateway.url + "/v1/chat/completions", data=chunks()) as response:
        status, body = await answer(response)
        assert response.headers["X-Request-Id"]  # the one it made for the refused request
    error = openai_error(body)
    assert status == 413 and error["code"] == "request_too_large"
    assert error["message"] == f"request body is larger than limits.max_body_bytes ({LIMIT} bytes)"


async def test_scheduler(real_scheduler, http):
    url = real_scheduler.url
    # Every path answers in the one plain envelope (/v1/models/... is not KServe v1 here).
    async with http.get(url + "/v1/models/a/b") as response:
        status, body = await answer(response)
        assert "X-Request-Id" not in response.headers
    assert status == 404 and openai_error(body)["message"] == "no route for GET /v1/models/a/b"
    async with http.post(url + "/v1/models/iris") as response:
        status, body = await answer(response)
        assert response.headers["Allow"] == "DELETE, GET, HEAD, PUT"
    assert status == 405 and openai_error(body) == {
        "message": "method POST is not allowed on /v1/models/iris; allowed: DELETE, GET, HEAD, PUT",
        "type": "invalid_request_error",
        "param": None,
        "code": "method_not_allowed",
    }
    async with http.put(url + "/v1/models/iris", data=chunks()) as response:
        status, body = await answer(response)
    assert status == 413 and openai_error(body)["message"] == f"request body is larger than {LIMIT} bytes"


async def test_agent_data_plane(setup, http):
    _fake, agent, _worker = await setup(max_body_bytes=LIMIT)
    too_large = f"request body is larger than the agent's max_body_bytes ({LIMIT} bytes)"
    async with http.post(agent.url + "/v2/models/iris/infer", data=chunks()) as response:
        assert await answer(response) == (413, {"error": too_large})
    async with http.post(agent.url + "/v1/chat/completions", data=chunks()) as response:
        status, body = await answer(response)
    assert status == 413 and openai_error(body)["message"] == too_large
    # Every other path is the agent's own 404 (a route takes every method: no 405 here).
    async with http.delete(agent.url + "/v2/repository/index") as response:
        status, body = await answer(response)
    assert status == 404 and "not an inference path" in oip_error(body)


async def test_sim_worker_answers_as_before(sim_workers, http):
    (worker,) = await sim_workers(1)
    async with http.put(worker.url + "/sim/config", json={"nope": 1}) as response:
        status, body = await answer(response)  # a /sim/ route answers as OIP does
    assert status == 400 and oip_error(body).startswith("cannot change nope at runtime")
    async with http.post(worker.url + "/v1/completions", data=b"[]") as response:
        assert await answer(response) == (
            400,
            {
                "error": {
                    "message": "the JSON body must be an object",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_json",
                }
            },
        )
    async with http.get(worker.url + "/nothing") as response:  # aiohttp's, as a server's would be
        assert response.status == 404 and response.content_type == "text/plain"


# --- the middleware's own cases, on a small application --------------------------------------


async def serve(errors: ServiceErrors, routes: list[web.RouteDef]) -> tuple[web.AppRunner, str]:
    app = web.Application(middlewares=[errors.middleware], client_max_size=LIMIT)
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def bug(request: web.Request) -> web.Response:
    request[REQUEST_ID] = "set-by-the-handler"
    raise RuntimeError("a bug")


async def refused(request: web.Request) -> web.Response:
    raise NotFound("nothing here", headers={"Retry-After": "3"})


async def broken_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b"data: 1\n\n")
    await asyncio.sleep(0.05)
    raise NotFound("too late to answer")


@pytest.mark.parametrize("request_ids", [True, False])
async def test_a_bug_is_logged_with_its_traceback_and_answered_without_it(http, caplog, request_ids):
    errors = ServiceErrors("agent", request_ids=request_ids)
    runner, url = await serve(errors, [web.get("/v2/bug", bug), web.get("/refused", refused)])
    try:
        with caplog.at_level(logging.ERROR, logger="modelyard.agent"):
            async with http.get(url + "/v2/bug") as response:
                assert await answer(response) == (500, {"error": "internal agent error; see the agent log"})
                assert response.headers.get("X-Request-Id") == ("set-by-the-handler" if request_ids else None)
        async with http.get(url + "/refused", headers={"X-Request-Id": "client"}) as response:
            status, body = await answer(response)
            assert response.headers["Retry-After"] == "3"  # the error's own headers
            assert response.headers.get("X-Request-Id") == ("client" if request_ids else None)
        assert status == 404 and openai_error(body)["message"] == "nothing here"
    finally:
        await runner.cleanup()
    (record,) = [r for r in caplog.records if r.name == "modelyard.agent"]
    expected = "unhandled error on GET /v2/bug" + (" (request set-by-the-handler)" if request_ids else "")
    assert record.getMessage() == expected
    assert record.exc_info is not None and "a bug" in str(record.exc_info[1])


async def test_a_fixed_envelope_overrides_the_paths(http):
    runner, url = await serve(ServiceErrors("scheduler", protocol=Protocol.PLAIN), [])
    try:
        async with http.get(url + "/v2/models/m") as response:
            status, body = await answer(response)
    finally:
        await runner.cleanup()
    assert status == 404 and openai_error(body)["code"] == "not_found"


async def test_an_error_after_the_answer_began_breaks_the_connection_not_the_stream(http):
    """A second answer written into a stream would reach the client as its body; aiohttp closes
    the connection instead, as the lean listener does."""
    runner, url = await serve(ServiceErrors("gateway"), [web.get("/v1/stream", broken_stream)])
    try:
        async with http.get(url + "/v1/stream") as response:
            assert response.status == 200
            assert await response.content.readline() == b"data: 1\n"
            with pytest.raises(aiohttp.ClientPayloadError):
                async with asyncio.timeout(5):  # (a second answer in the stream: the body never ends)
                    await response.read()
    finally:
        await runner.cleanup()
