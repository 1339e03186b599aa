"""The request path against hostile clients and failing backends: every case here broke the gateway
before (a 500 and a blocked loop, a stall, lost requests, a forwarded path escape)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from support import free_ports, metric_value, model_config, sim_stats

CHAT = "/v1/chat/completions"


def chat(content: str = "hello") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


# --- 1. deeply nested admin bodies -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/admin/graphs/g", b"[" * 20_000),
        ("/admin/models/m/routes", b"[" * 20_000),
        ("/admin/models/m/routes", b"- " * 5_000 + b"x"),
        ("/admin/models/m/routes", b"{" * 20_000),
    ],
)
async def test_deeply_nested_admin_bodies_are_400_with_no_traceback(
    sim_workers, gateways, http, caplog, path, body
):
    gateway = await gateways([model_config("m", await sim_workers(1))])
    with caplog.at_level(logging.WARNING):
        async with http.put(gateway.url + path, data=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    problems = " ".join(error.get("problems", [])) + error["message"]
    assert "nested deeper than 64 levels" in problems
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    async with http.post(gateway.url + CHAT, json=chat()) as response:
        assert response.status == 200  # and the gateway serves on


async def test_yaml_alias_bombs_are_refused(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))])
    layers = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    layers += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    body = ("\n".join(layers) + "\nroutes: *a8\n").encode()
    async with http.put(gateway.url + "/admin/models/m/routes", data=body) as response:
        assert response.status == 400
        assert "aliases" in (await response.json())["error"]["message"]


async def test_admin_bodies_have_their_own_size_limit(sim_workers, gateways, http):
    gateway = await gateways([model_config("m", await sim_workers(1))], limits={"max_admin_body_bytes": 1024})
    body = b"routes: []\n" + b"#" * 2048
    async with http.put(gateway.url + "/admin/models/m/routes", data=body) as response:
        assert response.status == 413
        assert "limits.max_admin_body_bytes" in (await response.json())["error"]["message"]

    async def chunked():  # no Content-Length: refused once the bytes read pass the limit
        for _ in range(64):
            yield b"#" * 512

    async with http.put(gateway.url + "/admin/models/m/routes", data=chunked()) as response:
        assert response.status == 413


# --- 2. a hung backend -------------------------------------------------------------------------------


class Freezable:
    """An OpenAI-shaped server that can stop answering anything, health checks included, while
    keeping its connections open: what a SIGSTOPped or wedged server looks like from outside."""

    def __init__(self) -> None:
        self.url = ""
        self.frozen = False
        self.thaw = asyncio.Event()
        self.requests = 0

    async def _wait_if_frozen(self) -> None:
        if self.frozen:
            await self.thaw.wait()

    async def chat(self, request: web.Request) -> web.Response:
        self.requests += 1
        await request.read()
        await self._wait_if_frozen()
        message = {"role": "assistant", "content": "thawed"}
        return web.json_response({"object": "chat.completion", "choices": [{"index": 0, "message": message}]})

    async def health(self, request: web.Request) -> web.Response:
        await self._wait_if_frozen()
        return web.json_response({"healthy": True})


@pytest.fixture
async def freezable() -> AsyncIterator[Callable[[], Awaitable[Freezable]]]:
    runners: list[tuple[Freezable, web.AppRunner]] = []

    async def start() -> Freezable:
        server = Freezable()
        app = web.Application()
        app.router.add_post(CHAT, server.chat)
        app.router.add_get("/health", server.health)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append((server, runner))
        server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return server

    yield start
    for server, runner in runners:
        server.thaw.set()
        await runner.cleanup()


async def test_requests_waiting_on_a_hung_backend_are_retried_once_its_health_check_fails(
    freezable, sim_workers, gateways, http
):
    hung = await freezable()
    (worker,) = await sim_workers(1)
    config = model_config("m", [])
    config["endpoints"] = [{"name": "hung", "url": hung.url}, {"name": "ok", "url": worker.url}]
    config["health_check"] = {"interval": "300ms", "unhealthy_interval": "100ms", "timeout": "100ms"}
    gateway = await gateways([config])
    hung.frozen = True
    async with asyncio.timeout(20):  # the route's own timeout is the default 10 minutes
        answers = await asyncio.gather(*(post(http, gateway.url) for _ in range(8)))
    assert all(status == 200 for status, _ in answers)
    assert {backend for _, backend in answers} == {"ok"}
    assert hung.requests >= 1  # some went there first, and were taken back
    retried = await metric_value(http, gateway.url, "modelyard_retries_total", reason="reset")
    assert retried == hung.requests
    # Taken out by its health check; the aborted tries are not 5xx answers to eject it for.
    ejections = await metric_value(
        http, gateway.url, "modelyard_outlier_events_total", event="consecutive_5xx"
    )
    assert ejections == 0


async def post(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.post(url + CHAT, json=chat()) as response:
        await response.read()
        return response.status, response.headers.get("X-Modelyard-Backend", "")


# --- 3. a backend killed under load -------------------------------------------------------------------


class SimProcess:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "modelyard",
                "sim-worker",
                "--port",
                str(port),
                "--decode-ms-per-token",
                "5",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
async def sim_processes(http) -> AsyncIterator[Callable[[int], Awaitable[list[SimProcess]]]]:
    started: list[SimProcess] = []

    async def start(n: int) -> list[SimProcess]:
        workers = [SimProcess(port) for port in free_ports(n)]
        started.extend(workers)
        for worker in workers:
            for _ in range(500):  # bounded: up to 10 s for the interpreter to start and bind
                try:
                    async with http.get(worker.url + "/health") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"sim worker at {worker.url} did not start")
        return workers

    yield start
    for worker in started:
        if worker.process.poll() is None:
            worker.process.terminate()
            worker.process.wait(timeout=10)


async def test_a_backend_killed_under_load_loses_no_request_with_the_default_config(
    sim_processes, gateways, http
):
    workers = await sim_processes(3)
    endpoints = [{"name": f"w{i}", "url": w.url} for i, w in enumerate(workers)]
    gateway = await gateways([{"name": "sim-model", "endpoints": endpoints}])  # every default
    total, concurrency, kill_after = 600, 16, 150
    statuses: list[int] = []
    done = asyncio.Event()

    async def client() -> None:
        while len(statuses) < total:
            body = {**chat(), "model": "sim-model"}
            async with http.post(gateway.url + CHAT, json=body) as response:
                await response.read()
                statuses.append(response.status)
            if len(statuses) >= kill_after:
                done.set()

    clients = [asyncio.create_task(client()) for _ in range(concurrency)]
    async with asyncio.timeout(120):
        await done.wait()
        workers[0].kill()
        await asyncio.gather(*clients)
    assert len(statuses) >= total
    assert [s for s in statuses if s != 200] == []
    assert await metric_value(http, gateway.url, "modelyard_retry_budget_exhausted_total") == 0


async def healthy(request: web.Request) -> web.Response:
    return web.json_response({})


async def test_one_connection_closed_without_an_answer_fails_nothing_else(sim_workers, gateways, http):
    """A request that crashes its worker (the server drops the connection) is retried, and costs
    the other requests in flight on that server nothing: the server is not taken out for it."""

    async def chat_or_drop(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b"poison" in body:
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        await asyncio.sleep(0.3)
        message = {"role": "assistant", "content": "ok"}
        return web.json_response({"object": "chat.completion", "choices": [{"index": 0, "message": message}]})

    urls = []
    runners = []
    for _ in range(2):
        app = web.Application()
        app.router.add_post(CHAT, chat_or_drop)
        app.router.add_get("/health", healthy)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        endpoints = [{"name": f"w{i}", "url": url} for i, url in enumerate(urls)]
        gateway = await gateways([{"name": "m", "endpoints": endpoints}])  # every default
        normal = [asyncio.create_task(post(http, gateway.url)) for _ in range(6)]
        await asyncio.sleep(0.05)  # the six are in flight on both servers
        async with http.post(gateway.url + CHAT, json=chat("poison")) as response:
            assert response.status == 502  # it crashed every server it was tried on
        assert [status for status, _ in await asyncio.gather(*normal)] == [200] * 6
        async with http.get(gateway.url + "/readyz") as response:
            assert response.status == 200
        transitions = "modelyard_endpoint_health_transitions_total"
        assert await metric_value(http, gateway.url, transitions, to="unhealthy") == 0
    finally:
        for runner in runners:
            await runner.cleanup()


# --- 9. path segments that escape the routed resource -----------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/m/versions/..%2F..%2Fsim%2Fstats/infer",
        "/v2/models/m/versions/..%2F..%2Fsim%2Fstats",
        "/v2/models/%2e%2e/ready",
        "/v1/models/m%2F..:predict",
        "/v2/models/m/versions/a%5Cb",
    ],
)
async def test_path_segments_decoding_to_a_slash_or_dot_dot_are_400(sim_workers, gateways, http, path):
    (worker,) = await sim_workers(1, models=["m"])
    gateway = await gateways([model_config("m", [worker])])
    method = "POST" if path.endswith(("infer", ":predict")) else "GET"
    url = URL(gateway.url + path, encoded=True)  # as sent: the client must not normalise it
    async with http.request(method, url, json={"inputs": []}) as response:
        assert response.status == 400
        body = await response.json()
    assert isinstance(body["error"], str) and "path segment" in body["error"]  # OIP / KServe v1 shape
    assert (await sim_stats(http, worker))["requests_total"] == 0  # nothing was forwarded


# --- 10. admin authentication ---------------------------------------------------------------------------


async def test_admin_401s_say_how_to_authenticate_and_accept_the_scheme_in_any_case(
    sim_workers, gateways, http
):
    gateway = await gateways([model_config("m", await sim_workers(1))], admin={"token": "s3cret"})
    async with http.get(gateway.url + "/admin/strategy") as response:
        assert response.status == 401
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="modelyard admin"'
    async with http.get(
        gateway.url + "/admin/strategy", headers={"Authorization": "Bearer nope"}
    ) as response:
        assert response.status == 401
        assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
    for scheme in ("Bearer", "bearer", "BEARER"):
        headers = {"Authorization": f"{scheme} s3cret"}
        async with http.get(gateway.url + "/admin/strategy", headers=headers) as response:
            assert response.status == 200, scheme
    async with http.get(
        gateway.url + "/admin/strategy", headers={"Authorization": "Basic s3cret"}
    ) as response:
        assert response.status == 401
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"GET /admin/strategy HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
    writer.write(head + b"Connection: close\r\n\r\n")
    assert (await reader.read()).startswith(b"HTTP/1.1 401 ")  # a token that is not UTF-8: not a 500
    writer.close()


@pytest.mark.parametrize("protect", [False, True])
async def test_graph_views_are_protected_on_request(sim_workers, gateways, http, protect):
    workers = await sim_workers(1)
    graph = {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [{"serviceUrl": workers[0].url + "/v1/models/m:predict"}],
            }
        }
    }
    gateway = await gateways(
        [model_config("m", workers)],
        admin={"token": "s3cret", "protect_graph_views": protect},
        graphs={"g": graph},
    )
    for path in ("/v1/graphs", "/v1/graphs/g"):
        async with http.get(gateway.url + path) as response:
            assert response.status == (401 if protect else 200)
        async with http.get(gateway.url + path, headers={"Authorization": "Bearer s3cret"}) as response:
            assert response.status == 200
