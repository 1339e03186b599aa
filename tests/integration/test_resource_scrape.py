"""ResourceScraper against real servers on port 0: sim workers' vLLM metrics and a custom exporter."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from aiohttp import web

from modelyard.balancing import RoutingContext
from modelyard.balancing.strategies import ResourceAware
from modelyard.cluster import BackendLoad, Endpoint
from modelyard.config import ResourceAwareConfig
from modelyard.simworker import SimWorker
from modelyard.types import RoutingRequest
from modelyard.upstream.http1 import Http1Client
from modelyard.upstream.scrape import ResourceScraper
from support import wait_until

SLOTS = 1
QUEUED = 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def endpoint(name: str, url: str, *, metrics_url: str = "", gpu_metrics_url: str = "") -> Endpoint:
    load = BackendLoad(url=url, name=name)
    return Endpoint(name, url, load, metrics_url=metrics_url, gpu_metrics_url=gpu_metrics_url)


def pick(endpoints: Sequence[Endpoint], config: ResourceAwareConfig, now: float) -> str:
    ctx = RoutingContext(request=RoutingRequest(model="m"), now=now)
    strategy = ResourceAware(config)
    return endpoints[strategy.pick(endpoints, ctx, random.Random(0)).index].name


@pytest.fixture
async def client() -> AsyncIterator[Http1Client]:
    client = Http1Client(max_connections=4, connect_timeout=1.0)
    yield client
    client.close()


@pytest.fixture
async def exporter() -> AsyncIterator[Any]:
    """`await exporter(routes)` serves aiohttp `routes` on a free port and returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(routes: list[web.RouteDef]) -> str:
        app = web.Application()
        app.add_routes(routes)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def queue_up(http, worker: SimWorker, count: int) -> list[asyncio.Task[Any]]:
    """`count` long completions against `worker`; with one slot, all but one wait in its queue."""

    async def long_request() -> None:
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 2000}
        async with http.post(worker.url + "/v1/completions", json=body) as response:
            await response.read()

    tasks = [asyncio.create_task(long_request()) for _ in range(count)]

    async def queued() -> bool:
        return worker.stats.waiting == count - SLOTS

    await wait_until(queued)
    return tasks


async def cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_queued_worker_scrapes_deeper_and_the_idle_one_is_picked(sim_workers, client, http):
    busy_worker, idle_worker = await sim_workers(2, max_concurrency=SLOTS, decode_ms_per_token=20.0)
    busy, idle = endpoint("busy", busy_worker.url), endpoint("idle", idle_worker.url)
    config = ResourceAwareConfig()
    clock = FakeClock()
    errors: list[str] = []
    scraper = ResourceScraper(
        lambda: [busy, idle], client, config, clock=clock, on_error=lambda e, m: errors.append(m)
    )
    tasks = await queue_up(http, busy_worker, SLOTS + QUEUED)
    try:
        await scraper.scrape_once()
    finally:
        await cancel(tasks)
    assert errors == []
    assert busy.resources is not None and idle.resources is not None
    assert busy.resources.queue_depth == QUEUED
    assert busy.resources.running == SLOTS
    assert idle.resources.queue_depth == 0 and idle.resources.running == 0
    assert idle.resources.kv_cache_usage == 0.0
    assert busy.resources.sm_utilization is None  # no DCGM exporter here
    assert pick([busy, idle], config, clock.now) == "idle"
    assert pick([idle, busy], config, clock.now) == "idle"


async def test_each_scrape_swaps_in_a_new_snapshot_with_the_in_flight_count(sim_workers, client):
    (worker,) = await sim_workers(1)
    ep = endpoint("w", worker.url)
    clock = FakeClock()
    scraper = ResourceScraper(lambda: [ep], client, ResourceAwareConfig(), clock=clock)
    await scraper.scrape_once()
    first = ep.resources
    ep.load.acquire(10)
    ep.load.acquire(10)
    clock.now = 5.0
    await scraper.scrape_once()
    assert ep.resources is not first
    assert first is not None and first.taken_at == 0.0 and first.in_flight_at_scrape == 0
    assert ep.resources is not None and ep.resources.taken_at == 5.0 and ep.resources.in_flight_at_scrape == 2


async def test_a_stopped_worker_keeps_its_snapshot_until_it_goes_stale(sim_workers, client):
    live_worker, dead_worker = await sim_workers(2)
    live, dead = endpoint("live", live_worker.url), endpoint("dead", dead_worker.url)
    config = ResourceAwareConfig(stale_after=15.0)
    clock = FakeClock()
    failures: list[tuple[str, str]] = []
    scraper = ResourceScraper(
        lambda: [live, dead], client, config, clock=clock, on_error=lambda e, m: failures.append((e.name, m))
    )
    await scraper.scrape_once()
    old = dead.resources
    assert old is not None and failures == []

    await dead_worker.stop()
    for _ in range(3):
        live.load.acquire(100)  # sent since the scrape: the live endpoint now scores lower
    clock.now = 10.0
    await scraper.scrape_once()
    assert dead.resources is old  # the failed scrape left the old snapshot in place
    assert [name for name, _ in failures] == ["dead"]
    assert dead_worker.url in failures[0][1]
    assert live.resources is not None and live.resources.taken_at == 10.0
    live.load.acquire(100)
    assert pick([live, dead], config, clock.now) == "dead"  # 10 s old: still trusted

    clock.now = 16.0
    await scraper.scrape_once()
    assert dead.resources is old and len(failures) == 2
    assert pick([live, dead], config, clock.now) == "live"  # 16 s old: stale, skipped


VLLM_AND_DCGM = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 2
vllm:num_requests_waiting{model_name="b"} 5
DCGM_FI_DEV_GPU_UTIL{gpu="0"} 80
DCGM_FI_DEV_GPU_UTIL{gpu="1"} 40
DCGM_FI_DEV_FB_USED{gpu="0"} 30
DCGM_FI_DEV_FB_FREE{gpu="0"} 70
"""


async def test_a_custom_metrics_url_is_honoured(sim_workers, exporter, client):
    (worker,) = await sim_workers(1)
    seen: list[str] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append(request.path_qs)
        return web.Response(text=VLLM_AND_DCGM)

    exporter_url = await exporter([web.get("/custom/prom", metrics)])
    ep = endpoint("w", worker.url, metrics_url=exporter_url + "/custom/prom?gpu=all")
    scraper = ResourceScraper(lambda: [ep], client, ResourceAwareConfig())
    await scraper.scrape_once()
    assert seen == ["/custom/prom?gpu=all"]
    assert ep.resources is not None
    assert ep.resources.queue_depth == 7.0
    assert ep.resources.sm_utilization == pytest.approx(0.6)
    assert ep.resources.memory_used == pytest.approx(0.3)
    assert worker.stats.requests_total == 0  # the worker itself was not asked


async def test_an_empty_metrics_url_means_the_default(sim_workers, client):
    (worker,) = await sim_workers(1)
    ep = endpoint("w", worker.url, metrics_url="")
    await ResourceScraper(lambda: [ep], client, ResourceAwareConfig()).scrape_once()
    assert ep.resources is not None and ep.resources.queue_depth == 0


async def test_bad_answers_are_reported_and_keep_the_old_snapshot(exporter, client):
    answers = iter(
        [
            web.Response(text="vllm:num_requests_waiting 1\n"),
            web.Response(status=500, text="boom"),
            web.Response(text='vllm:num_requests_waiting{model="x} 1\n'),
        ]
    )

    async def metrics(request: web.Request) -> web.Response:
        return next(answers)

    url = await exporter([web.get("/metrics", metrics)])
    ep = endpoint("x", url)
    failures: list[str] = []
    config = ResourceAwareConfig()
    scraper = ResourceScraper(lambda: [ep], client, config, on_error=lambda e, m: failures.append(m))
    await scraper.scrape_once()
    good = ep.resources
    await scraper.scrape_once()
    await scraper.scrape_once()
    assert ep.resources is good
    assert len(failures) == 2
    assert "answered 500" in failures[0]
    assert "malformed" in failures[1]


async def test_a_scrape_is_bounded_by_the_interval(exporter, client):
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="")

    url = await exporter([web.get("/metrics", hang)])
    ep = endpoint("slow", url)
    failures: list[str] = []
    config = ResourceAwareConfig(scrape_interval=0.2)
    scraper = ResourceScraper(lambda: [ep], client, config, on_error=lambda e, m: failures.append(m))
    try:
        await asyncio.wait_for(scraper.scrape_once(), timeout=5)
    finally:
        release.set()
    assert ep.resources is None
    assert len(failures) == 1 and "0.2s" in failures[0]


async def test_start_scrapes_in_the_background_until_stopped(sim_workers, client):
    (worker,) = await sim_workers(1)
    ep = endpoint("w", worker.url)
    scraper = ResourceScraper(lambda: [ep], client, ResourceAwareConfig(scrape_interval=0.01))
    taken: set[float] = set()

    async def scraped_twice() -> bool:
        if ep.resources is not None:
            taken.add(ep.resources.taken_at)
        return len(taken) >= 2

    scraper.start()
    try:
        await wait_until(scraped_twice)
    finally:
        await scraper.stop()
    after_stop = ep.resources
    await scraper.stop()  # idempotent
    assert ep.resources is after_stop


async def test_default_error_reporting_logs_once_per_outage(exporter, client, caplog):
    async def unavailable(request: web.Request) -> web.Response:
        return web.Response(status=503)

    url = await exporter([web.get("/metrics", unavailable)])
    scraper = ResourceScraper(lambda: [endpoint("down", url)], client, ResourceAwareConfig())
    with caplog.at_level("WARNING", logger="modelyard.upstream"):
        await scraper.scrape_once()
        await scraper.scrape_once()
    assert len(caplog.records) == 1
    assert "down" in caplog.records[0].getMessage() and "503" in caplog.records[0].getMessage()


async def test_a_dcgm_exporter_beside_the_server_adds_gpu_signals(sim_workers, exporter, client):
    (worker,) = await sim_workers(1)
    dcgm = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 80\n'
        'DCGM_FI_DEV_FB_USED{gpu="0"} 6000\n'
        'DCGM_FI_DEV_FB_FREE{gpu="0"} 2000\n'
    )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=dcgm)

    gpu_url = await exporter([web.get("/metrics", metrics)])
    ep = endpoint("w", worker.url, gpu_metrics_url=gpu_url + "/metrics")
    scraper = ResourceScraper(lambda: [ep], client, ResourceAwareConfig())
    await scraper.scrape_once()
    assert ep.resources is not None
    assert ep.resources.queue_depth == 0  # from the server itself
    assert ep.resources.sm_utilization == pytest.approx(0.8)  # from the exporter
    assert ep.resources.memory_used == pytest.approx(0.75)


async def test_an_unreachable_gpu_exporter_leaves_the_servers_own_signals(sim_workers, client):
    (worker,) = await sim_workers(1)
    ep = endpoint("w", worker.url, gpu_metrics_url="http://127.0.0.1:1/metrics")
    scraper = ResourceScraper(lambda: [ep], client, ResourceAwareConfig())
    await scraper.scrape_once()
    assert ep.resources is not None
    assert ep.resources.queue_depth == 0
    assert ep.resources.sm_utilization is None and ep.resources.memory_used is None
