"""`modelyard serve --workers 2`: two gateway processes on one port that route as one gateway."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import yaml
from aiohttp import web

from modelyard.gateway.routing_log import DEFAULT_SIZE, REFUSED_BURST, REFUSED_PER_SECOND
from support import free_ports, model_config, wait_until

GRPC_LINE = re.compile(r"^OIP v2 over gRPC \(inference.GRPCInferenceService\) on 127\.0\.0\.1:(\d+)$")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _model(workers: list[Any], strategy: str = "least_pending", **settings: Any) -> dict[str, Any]:
    endpoints = [{"url": w.url, "name": f"w{i}"} for i, w in enumerate(workers)]
    return {"name": "m", "strategy": strategy, "endpoints": endpoints, **settings}


async def _chat(session: aiohttp.ClientSession, url: str, max_tokens: int = 1) -> str:
    body = orjson.dumps({**CHAT, "max_tokens": max_tokens})
    async with session.post(url + "/v1/chat/completions", data=body) as response:
        assert response.status == 200, await response.text()
        return response.headers["X-Modelyard-Backend"]


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as response:
        return await response.text()


def _sum(text: str, metric: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{metric}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


async def serve_on_two_ports(app: web.Application) -> tuple[web.AppRunner, list[int]]:
    """`app` on two free ports of loopback, as two servers a gateway sees as two endpoints."""
    runner = web.AppRunner(app)
    await runner.setup()
    ports = []
    for _ in range(2):
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    return runner, ports


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
        # (a worker's counts reach its files, which any worker's scrape sums, within FOLLOW_SECONDS)
        text = ""

        async def summed(index: int = index) -> bool:
            nonlocal text
            text = await _metrics(await gateway.on_worker(index), gateway.url)
            counts = re.findall(r'^modelyard_requests_total\{[^}]*code="200"[^}]*\} (\S+)$', text, re.M)
            # (a scrape reads each worker's files in turn: its counters', then its histograms')
            timed = re.search(r'^modelyard_request_duration_seconds_count\{model="m"\} (\S+)$', text, re.M)
            return sum(float(c) for c in counts) >= 30 and timed is not None and float(timed[1]) >= 30

        await wait_until(summed, attempts=100, interval=0.02)
        counts = re.findall(r'^modelyard_requests_total\{[^}]*code="200"[^}]*\} (\S+)$', text, re.M)
        assert sum(float(c) for c in counts) == 30  # each request once, not twice
        assert re.search(r'^modelyard_request_duration_seconds_count\{model="m"\} 30\.0$', text, re.M)
        # Each worker has its own live-log streams: labelled with the one that answered.
        assert re.search(rf'^modelyard_log_streams_open\{{worker="{index}"\}} 0\.0$', text, re.M), text


async def test_least_pending_sees_what_the_other_worker_has_in_flight(sim_workers, serve_workers):
    backends = await sim_workers(2, decode_ms_per_token=100.0)
    gateway = await serve_workers({"models": [_model(backends)]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    slow = asyncio.create_task(_chat(first, gateway.url, max_tokens=30))  # 3 s on one backend

    async def started() -> bool:
        return any(b.stats.running for b in backends)

    await wait_until(started)
    busy = next(f"w{i}" for i, b in enumerate(backends) if b.stats.running)
    picks = [await _chat(second, gateway.url) for _ in range(6)]
    assert not slow.done()  # still in flight on worker 0 while worker 1 picked
    assert busy not in picks, picks  # worker 1 saw worker 0's request in flight
    assert (await gateway.worker_of(first))["worker"] == 0  # the sessions stayed on their workers
    assert (await gateway.worker_of(second))["worker"] == 1
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
    async with first.put(gateway.url + "/admin/strategy", json={"strategy": "nope"}) as response:
        assert response.status == 400  # not applied, so not given to the other worker
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
    assert (await gateway.worker_of(first))["worker"] == 0  # each change came from the worker named
    assert (await gateway.worker_of(second))["worker"] == 1


async def test_one_worker_probes_and_the_other_follows_its_verdicts(serve_workers):
    probes: dict[int, int] = {}  # by the health server's port
    answers: dict[int, int] = {}

    async def health(request: web.Request) -> web.Response:
        port = int(request.host.rsplit(":", 1)[1])
        probes[port] = probes.get(port, 0) + 1
        return web.Response(status=answers[port])

    app = web.Application()
    app.router.add_get("/health", health)
    runner, ports = await serve_on_two_ports(app)
    counted, followed = ports
    answers.update({counted: 200, followed: 503})
    try:
        models = [
            # Probed once at start, then not for an hour: exactly one probe if only the leader probes.
            {"name": "m", "endpoints": [{"url": f"http://127.0.0.1:{counted}"}],
             "health_check": {"interval": 3600}},
            {"name": "v", "endpoints": [{"url": f"http://127.0.0.1:{followed}"}],
             "health_check": {"interval": 0.1, "unhealthy_interval": 0.1, "unhealthy_threshold": 1,
                              "healthy_threshold": 1}},
        ]  # fmt: skip
        gateway = await serve_workers({"models": models})
        sessions = [await gateway.on_worker(0), await gateway.on_worker(1)]
        assert probes[counted] == 1  # both workers serve; one of them probed
        for session in sessions:  # the follower served with the leader's first verdict already
            async with session.get(gateway.url + "/readyz") as response:
                assert (await response.json())["models_without_healthy_endpoints"] == ["v"]
        answers[followed] = 200
        async with asyncio.timeout(5):
            for session in sessions:  # both bring the endpoint back
                while True:
                    async with session.get(gateway.url + "/readyz") as response:
                        if response.status == 200:
                            break
                    await asyncio.sleep(0.02)
        assert probes[counted] == 1
        for index, session in enumerate(sessions):
            assert (await gateway.worker_of(session))["worker"] == index
    finally:
        await runner.cleanup()


async def test_a_connection_refused_on_the_follower_is_probed_again_soon(serve_workers):
    """The follower takes the endpoint out on a refused connection; the leader, which alone probes,
    probes it at unhealthy_interval (not the hour-long interval), and its healthy verdict brings it
    back on the follower."""

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    (port,) = free_ports(1)

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = await start()
    try:
        models = [
            {"name": "m", "endpoints": [{"url": f"http://127.0.0.1:{port}", "name": "w0"}],
             "health_check": {"interval": 3600, "unhealthy_interval": 0.2}},
        ]  # fmt: skip
        gateway = await serve_workers({"models": models})
        follower = await gateway.on_worker(1)
        assert await _chat(follower, gateway.url) == "w0"

        await runner.cleanup()  # refused from now on

        async def taken_out() -> bool:
            async with follower.post(
                gateway.url + "/v1/chat/completions", data=orjson.dumps(CHAT)
            ) as response:
                await response.read()
            async with follower.get(gateway.url + "/readyz") as response:
                return response.status == 503

        await wait_until(taken_out, attempts=100, interval=0.02)
        runner = await start()

        async def back() -> bool:
            async with follower.get(gateway.url + "/readyz") as response:
                return response.status == 200

        loop = asyncio.get_running_loop()
        started = loop.time()
        await wait_until(back, attempts=250, interval=0.02)  # 5 s, against an interval of an hour
        assert loop.time() - started < 5
        assert await _chat(follower, gateway.url) == "w0"
        assert (await gateway.worker_of(follower))["worker"] == 1
    finally:
        await runner.cleanup()


async def test_an_endpoint_one_worker_ejects_is_out_in_the_other(sim_workers, serve_workers):
    (good,) = await sim_workers(1, models=["m"])
    (bad_sim,) = await sim_workers(1, models=["m"], fail_rate=1.0)
    detection = {"consecutive_5xx": 2, "base_ejection_time": "60s", "max_ejection_percent": 50}
    retried = {"name": "all", "destinations": [{"subset": "default"}], "retries": {"retry_on": ["5xx"]}}
    model = _model([good, bad_sim], strategy="round_robin", outlier_detection=detection, routes=[retried])
    gateway = await serve_workers({"models": [model]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)

    async def ejected_in(session: aiohttp.ClientSession) -> bool:
        async with session.get(gateway.url + "/admin/overview") as response:
            (described,) = (await response.json())["models"]
        return next(e for e in described["endpoints"] if e["name"] == "w1")["ejection"]["ejected"]

    for _ in range(6):  # three tries on w1, each failing and retried on w0: out after the second
        await _chat(second, gateway.url)
    assert await ejected_in(second)
    await wait_until(lambda: ejected_in(first), attempts=200, interval=0.02)
    tried = bad_sim.stats.requests_total
    assert {await _chat(first, gateway.url) for _ in range(6)} == {"w0"}
    assert bad_sim.stats.requests_total == tried  # the first worker sent it nothing
    text = await _metrics(first, gateway.url)
    ejections = re.findall(r'modelyard_outlier_events_total\{[^}]*event="consecutive_5xx"[^}]*\} (\S+)', text)
    assert [float(v) for v in ejections] == [1.0]  # decided once, by the second worker


async def _ask(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, str]:
    """(the backend, X-Modelyard-Cache-Hit) of one chat request with `prompt`."""
    body = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": prompt}]})
    async with session.post(url + "/v1/chat/completions", data=body) as response:
        assert response.status == 200, await response.text()
        return response.headers["X-Modelyard-Backend"], response.headers["X-Modelyard-Cache-Hit"]


@pytest.mark.parametrize("strategy", ["kv_aware", "prefix_aware"])
async def test_the_workers_share_what_affinity_strategies_learn_without_redis(
    sim_workers, serve_workers, strategy
):
    """kv_aware's affinities (a set per new prompt) and prefix_aware's index (batches on a channel)
    reach the other worker through the shared rings: its first request for a prompt is a hit."""
    workers = await sim_workers(3, models=["m"])
    gateway = await serve_workers({"models": [_model(workers, strategy=strategy)]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    # Longer than prefix_aware's chunks (64 characters), and different from the first character.
    prompts = [f"conversation {i}: " + "tell me about this topic at length, please. " * 5 for i in range(8)]
    chosen = [await _ask(first, gateway.url, prompt) for prompt in prompts]
    assert {hit for _, hit in chosen} == {"false"}  # each new here: chosen, and remembered

    async def caught_up() -> bool:  # what the first worker learnt, the second has applied
        text = await _metrics(first, gateway.url)
        if strategy == "prefix_aware":  # records, in batches on the channel
            return _sum(text, r'modelyard_prefix_index_shared_total\{direction="received"\}') >= len(prompts)
        sent = _sum(text, r'modelyard_worker_state_messages_total\{event="sent"\}')
        applied = _sum(text, r'modelyard_worker_state_messages_total\{event="applied"\}')
        return sent >= len(prompts) and applied == sent

    await wait_until(caught_up, attempts=200, interval=0.02)
    again = [await _ask(second, gateway.url, prompt) for prompt in prompts]
    assert again == [(backend, "true") for backend, _ in chosen]  # the other worker's choice, as a hit


async def test_each_workers_routing_log_shows_every_workers_requests(sim_workers, serve_workers):
    workers = await sim_workers(2, models=["m"])
    gateway = await serve_workers({"models": [_model(workers)]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    sent = []
    for index, session in enumerate((first, second, second)):
        request_id = f"log-{index}"
        async with session.post(
            gateway.url + "/v1/chat/completions",
            data=orjson.dumps(CHAT),
            headers={"X-Request-Id": request_id},
        ) as response:
            assert response.status == 200
        sent.append(request_id)

    async def logged(session: aiohttp.ClientSession) -> list[str]:
        async with session.get(gateway.url + "/admin/log") as response:
            return [r["request_id"] for r in (await response.json())["records"]]

    for session in (first, second):
        await wait_until(lambda session=session: _has_all(logged(session), sent), attempts=200, interval=0.02)
        ids = [r for r in await logged(session) if r in sent]
        assert sorted(ids) == sorted(sent)  # each once


async def test_refusals_on_every_worker_leave_each_workers_routed_records_and_are_counted_once(
    sim_workers, serve_workers
):
    gateway = await serve_workers({"models": [_model(await sim_workers(1))]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    routed = []
    for index, session in enumerate((first, second)):
        async with session.post(
            gateway.url + "/v1/chat/completions",
            data=orjson.dumps(CHAT),
            headers={"X-Request-Id": f"r{index}"},
        ) as response:
            assert response.status == 200
        routed.append(f"r{index}")
    unknown, flood = orjson.dumps({**CHAT, "model": "nope"}), 500  # per worker, the ring's size
    started = asyncio.get_running_loop().time()
    for session in (first, second):
        for _ in range(flood):
            async with session.post(gateway.url + "/v1/chat/completions", data=unknown) as response:
                assert response.status == 404
    elapsed = asyncio.get_running_loop().time() - started
    recorded_at_most = 2 * (REFUSED_BURST + REFUSED_PER_SECOND * elapsed)  # each worker's bucket

    async def left_out_counted() -> bool:  # every worker's count, summed (they flush every 50 ms)
        return _sum(await _metrics(first, gateway.url), "modelyard_log_refusals_unrecorded_total") >= (
            2 * flood - recorded_at_most
        )

    await wait_until(left_out_counted, attempts=200, interval=0.02)
    for session in (first, second):  # each worker's log: every routed record, refusals apart
        async with session.get(gateway.url + "/admin/log") as response:
            records = (await response.json())["records"]
        assert sorted(r["request_id"] for r in records if not r["refused"]) == routed
        assert 0 < sum(r["refused"] for r in records) <= DEFAULT_SIZE // 2


async def test_the_overview_counts_each_models_requests_on_a_shared_server_over_every_worker(
    sim_workers, serve_workers
):
    (worker,) = await sim_workers(1, models=["m", "n"], decode_ms_per_token=20.0)
    gateway = await serve_workers({"models": [_model([worker]), {**_model([worker]), "name": "n"}]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    seen: list[tuple[int, int]] = []

    async def shown_by_the_first() -> bool:
        async with first.get(gateway.url + "/admin/overview") as response:
            endpoints = [m["endpoints"][0] for m in (await response.json())["models"]]
        seen[:] = [(e["model_in_flight"], e["in_flight"]) for e in endpoints]
        return seen == [(1, 1), (0, 1)]  # m's request, on the server n shares

    body = orjson.dumps({**CHAT, "max_tokens": 5000, "stream": True})
    async with second.post(gateway.url + "/v1/chat/completions", data=body) as long:
        await long.content.readline()  # running in the second worker
        await wait_until(shown_by_the_first, attempts=200, interval=0.02)
    assert seen == [(1, 1), (0, 1)]

    # The stream left unfinished closed second's connection: a new one may land on either worker.
    second = await gateway.on_worker(1)
    async with second.post(
        gateway.url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "model": "nope"})
    ) as refused:
        assert refused.status == 404
        request_id = refused.headers["X-Request-Id"]

    async def logged_by_the_first() -> bool:
        async with first.get(gateway.url + "/admin/log") as response:
            records = (await response.json())["records"]
        return any(r["request_id"] == request_id and r["refused"] and r["worker"] == 1 for r in records)

    await wait_until(logged_by_the_first, attempts=200, interval=0.02)


async def _has_all(found: Awaitable[list[str]], wanted: list[str]) -> bool:
    return set(wanted) <= set(await found)


async def test_the_canary_account_counts_every_workers_mirrored_requests(sim_workers, serve_workers):
    primary, canary = await sim_workers(2, models=["m"])
    endpoints = [
        {"url": primary.url, "name": "w0", "subset": "v1"},
        {"url": canary.url, "name": "w1", "subset": "v2"},
    ]
    mirrored = {
        "name": "shadowed",
        "destinations": [{"subset": "v1"}],
        "mirror": {"subset": "v2", "percent": 100},
    }
    model = {"name": "m", "endpoints": endpoints, "routes": [mirrored]}
    gateway = await serve_workers({"models": [model]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    for session in (first, second, second):
        await _chat(session, gateway.url)

    async def counted(session: aiohttp.ClientSession) -> bool:
        async with session.get(gateway.url + "/admin/models/m/canary") as response:
            summary = (await response.json())["routes"].get("shadowed")
        return summary is not None and summary["compared"] == 3 and summary["subsets"]["v2"]["requests"] == 3

    for session in (first, second):  # each worker's account holds the other's mirrored requests too
        await wait_until(lambda session=session: counted(session), attempts=200, interval=0.02)


async def test_one_worker_scrapes_and_the_other_routes_on_its_snapshots(serve_workers):
    """resource_aware: the leader alone scrapes (once per endpoint at start, then not for an hour),
    and the follower routes on the snapshots it published: away from the endpoint whose queue is full."""
    scrapes: dict[int, int] = {}  # by the server's port
    waiting: dict[int, int] = {}

    async def metrics(request: web.Request) -> web.Response:
        port = int(request.host.rsplit(":", 1)[1])
        scrapes[port] = scrapes.get(port, 0) + 1
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting {waiting[port]}\n"
            "# TYPE vllm:num_requests_running gauge\n"
            "vllm:num_requests_running 0\n"
        )
        return web.Response(text=text)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner, ports = await serve_on_two_ports(app)
    full, idle = ports
    waiting.update({full: 1000, idle: 0})  # past max_queue_depth: skipped while its snapshot holds
    try:
        endpoints = [{"url": f"http://127.0.0.1:{port}", "name": f"w{i}"} for i, port in enumerate(ports)]
        model = {
            "name": "m", "strategy": "resource_aware", "endpoints": endpoints,
            "health_check": {"interval": 3600},
            "resource_aware": {"scrape_interval": 3600, "stale_after": 3600},
        }  # fmt: skip
        gateway = await serve_workers({"models": [model]})
        follower = await gateway.on_worker(1)

        async def avoids_the_full_one() -> bool:  # by chance, 20 in a row: one in a million
            return all([await _chat(follower, gateway.url) == "w1" for _ in range(20)])

        await wait_until(avoids_the_full_one, attempts=100, interval=0.02)
        assert scrapes == {full: 1, idle: 1}  # one worker scraped: both served, the follower routed
        assert (await gateway.worker_of(follower))["worker"] == 1
    finally:
        await runner.cleanup()


async def test_a_killed_worker_is_started_again_and_sigterm_drains_all(sim_workers, serve_workers):
    gateway = await serve_workers({"models": [_model(await sim_workers(2, decode_ms_per_token=100.0))]})
    observer, doomed = await gateway.on_worker(0), await gateway.on_worker(1)
    victim = await gateway.worker_of(doomed)
    slow = asyncio.create_task(_chat(doomed, gateway.url, max_tokens=100))  # in flight on worker 1

    async def in_flight() -> float:
        return _sum(await _metrics(observer, gateway.url), "modelyard_backend_in_flight")

    async def one_in_flight() -> bool:
        return await in_flight() == 1

    await wait_until(one_in_flight)
    os.kill(victim["pid"], signal.SIGKILL)
    with pytest.raises(aiohttp.ClientError):
        await slow
    delay = 0.01
    async with asyncio.timeout(30):
        while True:
            async with aiohttp.ClientSession() as session:
                try:
                    worker = await gateway.worker_of(session)
                except aiohttp.ClientError:  # its listener was in the kernel's group: retry soon
                    worker = {}
                if worker.get("worker") == 1 and worker["pid"] != victim["pid"]:
                    await _chat(session, gateway.url)
                    break
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.2)
    # What the dead worker had in flight ended with it (its new self served one request since).
    assert await in_flight() == 0
    assert (await gateway.worker_of(observer))["worker"] == 0
    gateway.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(gateway.process.wait(), 30) == 0


async def test_a_stopped_worker_is_killed_and_replaced_within_seconds(sim_workers, serve_workers):
    # The probe's case: a worker frozen (SIGSTOP) keeps its share of the port, and the kernel keeps
    # handing it connections. With the default listen.worker_heartbeat_timeout (5 s).
    gateway = await serve_workers({"models": [_model(await sim_workers(2, decode_ms_per_token=100.0))]})
    observer, doomed = await gateway.on_worker(0), await gateway.on_worker(1)
    victim = (await gateway.worker_of(doomed))["pid"]
    slow = asyncio.create_task(_chat(doomed, gateway.url, max_tokens=100))  # in flight on worker 1

    async def in_flight() -> float:
        return _sum(await _metrics(observer, gateway.url), "modelyard_backend_in_flight")

    async def one_in_flight() -> bool:
        return await in_flight() == 1

    await wait_until(one_in_flight)
    stopped_at = asyncio.get_running_loop().time()
    os.kill(victim, signal.SIGSTOP)
    try:

        async def reaped() -> bool:  # killed, and its sockets closed with it
            try:
                os.kill(victim, 0)
            except ProcessLookupError:
                return True
            return False

        await wait_until(reaped, attempts=300, interval=0.05)  # 15 s: 5 s + a margin for a loaded machine
        killed_after = asyncio.get_running_loop().time() - stopped_at
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)  # never leave a stopped worker behind
    with pytest.raises(aiohttp.ClientError):
        await slow

    async def one_request() -> str:  # a connection of its own, which the kernel gives to either worker
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            return await _chat(session, gateway.url)

    # Requests flow again: 40 on fresh connections, 8 at a time, every one answered, in bounded time.
    async with asyncio.timeout(30):
        for _ in range(5):
            assert len(await asyncio.gather(*(one_request() for _ in range(8)))) == 8
    flowing_after = asyncio.get_running_loop().time() - stopped_at
    lines = [line for line in gateway.output if "sent no heartbeat" in line]
    assert len(lines) == 1, gateway.output  # logged once, naming the worker and why
    assert f"worker 1 (pid {victim}) sent no heartbeat for 5.0 s" in lines[0], lines
    assert not any("exited with" in line for line in gateway.output), gateway.output

    async def replaced() -> bool:  # its share of the port served by a new worker 1
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            worker = await gateway.worker_of(session)
            return worker["worker"] == 1 and worker["pid"] != victim

    await wait_until(replaced, attempts=300, interval=0.1)
    replaced_after = asyncio.get_running_loop().time() - stopped_at
    print(
        f"SIGSTOP -> killed {killed_after:.2f} s, 40 requests answered {flowing_after:.2f} s, "
        f"a new worker 1 serves {replaced_after:.2f} s"
    )
    assert killed_after < 15
    assert await in_flight() == 0  # what the frozen worker had in flight was released
    gateway.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(gateway.process.wait(), 30) == 0


async def test_a_switch_for_every_model_is_every_workers_default(sim_workers, serve_workers):
    gateway = await serve_workers({"models": [_model(await sim_workers(1))]})
    first, second = await gateway.on_worker(0), await gateway.on_worker(1)
    # Both in one round of the second worker's following: it is stopped (SIGSTOP) while the first
    # applies them, so it finds both at once when it goes on, and must end where the first is.
    paused = (await gateway.worker_of(second))["pid"]
    os.kill(paused, signal.SIGSTOP)
    try:
        async with first.put(gateway.url + "/admin/strategy", json={"strategy": "kv_aware"}) as response:
            assert response.status == 200
        async with first.put(
            gateway.url + "/admin/strategy", json={"strategy": "random", "model": "m"}
        ) as response:
            expected = await response.json()
    finally:
        os.kill(paused, signal.SIGCONT)
    assert (expected["default"], expected["overrides"]) == ("kv_aware", {"m": "random"})
    seen: dict[str, Any] = {}

    async def the_same() -> bool:
        async with second.get(gateway.url + "/admin/strategy") as response:
            seen.update(await response.json())
        return seen == expected

    await wait_until(the_same, attempts=250, interval=0.02)


async def test_a_second_group_on_the_same_port_is_refused(sim_workers, serve_workers, tmp_path):
    gateway = await serve_workers({"models": [_model(await sim_workers(1))]})
    port = int(gateway.url.rsplit(":", 1)[1])
    path = tmp_path / "second.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": port}}))
    second = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "serve", "-c", str(path), "--workers", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(second.communicate(), 60)
    assert second.returncode == 1, stdout.decode() + stderr.decode()
    lines = stderr.decode().strip().splitlines()
    assert lines == [f"error: cannot listen on 127.0.0.1:{port} (gateway HTTP): Address already in use"], (
        lines
    )


async def test_oip_grpc_is_served_by_both_workers_on_one_port(sim_workers, serve_workers, tmp_path):
    backends = await sim_workers(2, oip_scale=2.0, models=["echo"])
    listen = {"host": "127.0.0.1", "port": 0, "grpc_port": 0, "drain_seconds": 0}
    gateway = await serve_workers({"listen": listen, "models": [model_config("echo", backends)]})

    def grpc_port() -> int | None:  # from the line the parent prints once every worker serves
        found = (GRPC_LINE.search(line) for line in gateway.output)
        return next((int(match.group(1)) for match in found if match), None)

    async def announced() -> bool:
        return grpc_port() is not None

    await wait_until(announced)
    port = grpc_port()
    assert sum("OIP v2 over gRPC" in line for line in gateway.output) == 1  # the parent's line, once

    def infer() -> list[float]:
        # A fresh client each call on a connection of its own (grpc shares one process-wide unless
        # told not to), which the kernel gives to either worker.
        own_connection = [("grpc.use_local_subchannel_pool", 1)]
        triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}", channel_args=own_connection)
        try:
            tensor = grpcclient.InferInput("x", [2], "FP32")
            tensor.set_data_from_numpy(np.array([1.0, 2.5], dtype=np.float32))
            return triton.infer("echo", [tensor], client_timeout=30).as_numpy("x").tolist()  # type: ignore[no-any-return]
        finally:
            triton.close()

    answers = await asyncio.gather(*(asyncio.to_thread(infer) for _ in range(20)))
    assert answers == [[2.0, 5.0]] * 20

    async def answered_by(index: int) -> list[int]:  # each record names the worker that answered
        async with (await gateway.on_worker(index)).get(gateway.url + "/admin/log") as response:
            return [record["worker"] for record in (await response.json())["records"]]

    async def whole() -> bool:  # each worker's log holds every call, the other's too
        return [len(await answered_by(0)), len(await answered_by(1))] == [20, 20]

    await wait_until(whole, attempts=200, interval=0.02)
    by_worker = await answered_by(0)
    assert {0, 1} == set(by_worker), by_worker
    text = await _metrics(await gateway.on_worker(0), gateway.url)  # the sum counts every gRPC call
    assert re.search(r'^modelyard_request_duration_seconds_count\{model="echo"\} 20\.0$', text, re.M), text

    # A fixed gRPC port in use (this group's) is refused at start: one line, exit 1.
    path = tmp_path / "second.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0, "grpc_port": port}}))
    second = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "serve", "-c", str(path), "--workers", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(second.communicate(), 60)
    assert second.returncode == 1, stdout.decode() + stderr.decode()
    lines = stderr.decode().strip().splitlines()
    assert lines == [
        f"error: cannot listen on 127.0.0.1:{port} (gateway OIP gRPC): Address already in use"
    ], lines


def test_what_workers_cannot_share_yet_is_refused(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"listen": {"port": 0, "grpc_port": 0}}))
    result = subprocess.run(
        [sys.executable, "-m", "modelyard", "serve", "-c", str(path), "--workers", "2", "--scheduler", "h:1"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "listen.workers: placement.scheduler (placed models) works with one worker only" in result.stderr
    assert "grpc_port" not in result.stderr  # shared by the workers (the test above)


@pytest.mark.parametrize(("workers", "code"), [("1", 0), ("2", 1)])
def test_the_demo_takes_one_worker_from_the_environment(workers, code):
    result = subprocess.run(
        [sys.executable, "-m", "modelyard", "serve", "--print-config"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "COLUMNS": "200", "MODELYARD_LISTEN__WORKERS": workers},
    )  # fmt: skip
    assert result.returncode == code, result.stderr
    assert ("the demo runs one worker" in result.stderr) == (code == 1)
