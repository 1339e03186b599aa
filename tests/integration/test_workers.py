"""`modelyard serve --workers 2`: two gateway processes on one port that route as one gateway."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from support import wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


class Workers:
    """A `modelyard serve --workers 2` process and a way to reach each of its workers."""

    def __init__(self, process: asyncio.subprocess.Process, url: str) -> None:
        self.process = process
        self.url = url
        self.sessions: list[aiohttp.ClientSession] = []

    async def on_worker(self, index: int) -> aiohttp.ClientSession:
        """A session whose one keep-alive connection is served by worker `index`."""
        for _ in range(200):
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1, force_close=False),
                timeout=aiohttp.ClientTimeout(total=30),
            )
            self.sessions.append(session)
            if (await self.worker_of(session))["worker"] == index:
                return session
        raise AssertionError(f"no connection reached worker {index}")

    async def worker_of(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(self.url + "/healthz") as response:
            return await response.json()  # type: ignore[no-any-return]

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()


@pytest.fixture
async def serve_workers(tmp_path: Path) -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[Workers]]]:
    started: list[Workers] = []

    async def start(config: dict[str, Any]) -> Workers:
        path = tmp_path / "gateway.yaml"
        path.write_text(
            yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0, "drain_seconds": 0}, **config})
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "modelyard", "serve", "-c", str(path), "--workers", "2",
            "--log-level", "warning",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        assert process.stdout is not None
        output = ""
        while not (match := re.search(r"listening on (http://\S+) .*2 workers", output)):
            line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
            assert line, output
            output += line
        workers = Workers(process, match.group(1))
        started.append(workers)
        return workers

    yield start
    for workers in started:
        await workers.close()
        if workers.process.returncode is None:
            workers.process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(workers.process.wait(), 30)


def _model(workers: list[Any], strategy: str = "least_pending", **settings: Any) -> dict[str, Any]:
    endpoints = [{"url": w.url, "name": f"w{i}"} for i, w in enumerate(workers)]
    return {"name": "m", "strategy": strategy, "endpoints": endpoints, **settings}


async def _chat(session: aiohttp.ClientSession, url: str, max_tokens: int = 1) -> str:
    body = orjson.dumps({**CHAT, "max_tokens": max_tokens})
    async with session.post(url + "/v1/chat/completions", data=body) as response:
        assert response.status == 200, await response.text()
        return response.headers["X-Modelyard-Backend"]


async def test_requests_spread_over_both_workers_and_metrics_sum_them(sim_workers, serve_workers):
    gateway = await serve_workers({"models": [_model(await sim_workers(2))]})
    seen: dict[int, int] = {}
    for _ in range(30):  # a new connection each: the kernel spreads connections over the workers
        async with aiohttp.ClientSession() as session:
            worker = await gateway.worker_of(session)
            seen[worker["worker"]] = worker["pid"]
            await _chat(session, gateway.url)
    assert set(seen) == {0, 1} and seen[0] != seen[1]
    for index in (0, 1):  # either worker answers /metrics for both
        async with (await gateway.on_worker(index)).get(gateway.url + "/metrics") as response:
            text = await response.text()
        counts = re.findall(r'^modelyard_requests_total\{[^}]*code="200"[^}]*\} (\S+)$', text, re.M)
        assert sum(float(c) for c in counts) == 30
        assert re.search(r'^modelyard_request_duration_seconds_count\{model="m"\} 30\.0$', text, re.M)


async def test_least_pending_sees_what_the_other_worker_has_in_flight(sim_workers, serve_workers):
    backends = await sim_workers(2, decode_ms_per_token=100.0)
    gateway = await serve_workers({"models": [_model(backends)]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    slow = asyncio.create_task(_chat(first, gateway.url, max_tokens=15))  # 1.5 s on one backend

    async def started() -> bool:
        return any(b.stats.running for b in backends)

    await wait_until(started)
    busy = next(f"w{i}" for i, b in enumerate(backends) if b.stats.running)
    picks = [await _chat(second, gateway.url) for _ in range(6)]
    assert busy not in picks, picks  # worker 1 saw worker 0's request in flight
    assert await slow == busy


async def test_admin_changes_reach_every_worker(sim_workers, serve_workers):
    gateway = await serve_workers({"models": [_model(await sim_workers(2))]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    async with first.put(gateway.url + "/admin/strategy", json={"strategy": "round_robin"}) as response:
        assert response.status == 200
    routes = {"routes": [{"name": "all", "destinations": [{"subset": "default", "weight": 100}]}]}
    async with second.put(gateway.url + "/admin/models/m/routes", json=routes) as response:
        assert response.status == 200, await response.text()
    graph = "nodes:\n  root:\n    routerType: Sequence\n    steps:\n      - serviceName: m\n"
    async with first.put(gateway.url + "/admin/graphs/g", data=graph) as response:
        assert response.status == 200, await response.text()
    async with asyncio.timeout(5):
        while True:
            async with second.get(gateway.url + "/admin/strategy") as response:
                strategy = (await response.json())["strategy"]
            async with first.get(gateway.url + "/admin/models/m/routes") as response:
                names = [r["name"] for r in (await response.json())["routes"]]
            async with second.get(gateway.url + "/v1/graphs/g") as response:
                graph_seen = response.status == 200
            if strategy == "round_robin" and names == ["all"] and graph_seen:
                break
            await asyncio.sleep(0.02)
    async with second.delete(gateway.url + "/admin/graphs/g") as response:
        assert response.status == 200
    async with asyncio.timeout(5):
        while True:
            async with first.get(gateway.url + "/v1/graphs/g") as response:
                if response.status == 404:
                    break
            await asyncio.sleep(0.02)


async def test_one_worker_probes_and_the_other_follows_its_verdicts(sim_workers, serve_workers):
    probes = 0
    answer = 200

    async def health(_request: web.Request) -> web.Response:
        nonlocal probes
        probes += 1
        return web.Response(status=answer)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        check = {"interval": 0.1, "unhealthy_interval": 0.1, "unhealthy_threshold": 1}
        model = {"name": "m", "endpoints": [{"url": f"http://127.0.0.1:{port}"}], "health_check": check}
        gateway = await serve_workers({"models": [model]})
        start = probes
        await asyncio.sleep(1.0)  # measuring a rate: probes over one second
        assert probes - start <= 14, probes - start  # one worker's ~10 a second, not two workers' ~20
        answer = 503
        sessions = [await gateway.on_worker(0), await gateway.on_worker(1)]
        async with asyncio.timeout(5):
            for session in sessions:  # both take the endpoint out
                while True:
                    async with session.get(gateway.url + "/readyz") as response:
                        if response.status == 503:
                            break
                    await asyncio.sleep(0.02)
    finally:
        await runner.cleanup()


async def test_a_killed_worker_is_started_again_and_sigterm_drains_all(sim_workers, serve_workers):
    gateway = await serve_workers({"models": [_model(await sim_workers(2))]})
    victim = await gateway.worker_of(await gateway.on_worker(1))
    os.kill(victim["pid"], signal.SIGKILL)
    async with asyncio.timeout(30):
        while True:
            async with aiohttp.ClientSession() as session:
                try:
                    worker = await gateway.worker_of(session)
                except aiohttp.ClientError:
                    continue
                if worker["worker"] == 1 and worker["pid"] != victim["pid"]:
                    await _chat(session, gateway.url)
                    break
    gateway.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(gateway.process.wait(), 30) == 0


def test_what_workers_cannot_share_yet_is_refused(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"listen": {"port": 0, "grpc_port": 0}}))
    result = subprocess.run(
        [sys.executable, "-m", "modelyard", "serve", "-c", str(path), "--workers", "2", "--scheduler", "h:1"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "listen.workers: placement.scheduler (placed models) works with one worker only" in result.stderr
    assert "listen.workers: listen.grpc_port works with one worker only" in result.stderr
