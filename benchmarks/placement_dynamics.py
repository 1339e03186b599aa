"""Placement while traffic flows: the cost of a lazy reload and the scale-up reaction time.

  reload    One agent (1000 bytes, 100% overcommit) over a sim-worker whose load takes
            `--load-delay` seconds holds two 600-byte models that do not fit together. Requests
            alternate between them straight at the agent's data plane, so each one finds its model
            evicted: its latency is the reload's (evict the other, load this one) plus the request.
            Compared with the same request to a resident model and with the server's own load
            time (a load called on a second sim-worker directly).
  scale-up  A scheduler with its default autoscaling settings, two sim-workers with an agent each
            and a gateway; a model with max_replicas 2 on one replica. A burst of `--burst`
            concurrent requests through the gateway (each about 0.5 s) starts at t=0: the time
            until the scheduler decides to add a replica, until the new replica is Available, and
            until the gateway has sent it a request.

Run by hand: .venv/bin/python benchmarks/placement.py --dynamics-only  (or this file alone)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from modelyard.agent import AgentConfig, start_agent
from modelyard.config import validate_config
from modelyard.gateway import start_gateway
from modelyard.scheduler import SchedulerConfig, start_scheduler
from modelyard.simworker import SimWorker, SimWorkerConfig

OIP = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 25}
FAST = {"prefill_ms_per_token": 0.0, "decode_ms_per_token": 0.0, "port": 0}


async def _sim(**config: Any) -> SimWorker:
    worker = SimWorker(SimWorkerConfig(**{**FAST, **config}))
    await worker.start()
    return worker


async def _until(condition: Any, within: float = 60.0) -> None:
    """Poll the in-process scheduler's state (it has no event to wait on); bounded."""
    give_up = time.perf_counter() + within
    while not condition():
        if time.perf_counter() > give_up:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


async def _timed_post(http: aiohttp.ClientSession, url: str, body: object) -> float:
    started = time.perf_counter()
    async with http.post(url, json=body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status}")
    return time.perf_counter() - started


async def measure_reload(load_delay: float, rounds: int) -> dict[str, float]:
    """Medians in seconds: warm request, request after eviction, the server's own load."""
    scheduler = await start_scheduler(SchedulerConfig(port=0, agent_port=0, db=":memory:", autoscaling=False))
    worker = await _sim(repository_api=True, memory=1000, load_delay=load_delay)
    reference = await _sim(repository_api=True, memory=1000, load_delay=load_delay)
    agent = await start_agent(
        AgentConfig(
            scheduler=scheduler.agent_address,
            server_name="sim",
            inference_url=worker.url,
            memory_bytes=1000,
            overcommit_percent=100,
            unload_grace=0,
        )
    )
    try:
        async with aiohttp.ClientSession() as http:
            for name in ("a", "b"):
                spec = {"name": name, "storage_uri": f"sim://{name}", "memory": 600}
                async with http.put(f"{scheduler.url}/v1/models/{name}", json=spec) as response:
                    assert response.status == 200, await response.text()
            await _until(
                lambda: all(
                    scheduler.state.models[n].latest.status.state.value == "ModelAvailable"
                    for n in ("a", "b")
                )
            )
            warm, cold, server = [], [], []
            for _ in range(rounds):
                cold.append(await _timed_post(http, f"{agent.url}/v2/models/a/infer", OIP))  # a was evicted
                warm.append(await _timed_post(http, f"{agent.url}/v2/models/a/infer", OIP))  # resident now
                cold.append(await _timed_post(http, f"{agent.url}/v2/models/b/infer", OIP))
                warm.append(await _timed_post(http, f"{agent.url}/v2/models/b/infer", OIP))
                started = time.perf_counter()
                async with http.post(f"{reference.url}/v2/repository/models/r/load", json={}) as response:
                    assert response.status == 200
                server.append(time.perf_counter() - started)
                async with http.post(f"{reference.url}/v2/repository/models/r/unload", json={}) as response:
                    assert response.status == 200
    finally:
        await agent.stop()
        await scheduler.stop()
        await worker.stop()
        await reference.stop()
    return {
        "warm": statistics.median(warm),
        "cold": statistics.median(cold),
        "server_load": statistics.median(server),
    }


async def measure_scale_up(burst: int, deadline: float = 60.0) -> dict[str, float]:
    """Seconds from the burst's start to: the scale-up decision, the new replica Available, the
    first request the gateway sent to it."""
    scheduler = await start_scheduler(SchedulerConfig(port=0, agent_port=0, db=":memory:"))
    gateway = await start_gateway(
        validate_config({"listen": {"port": 0}, "placement": {"scheduler": scheduler.url}}, "<bench>")
    )
    workers = [await _sim(repository_api=True, decode_ms_per_token=20.0) for _ in range(2)]
    agents = [
        await start_agent(
            AgentConfig(
                scheduler=scheduler.agent_address,
                server_name="sim",
                replica_idx=i,
                inference_url=w.url,
                memory_bytes=10_000_000,
                unload_grace=0,
            )
        )
        for i, w in enumerate(workers)
    ]
    stop = asyncio.Event()
    marks: dict[str, float] = {}
    try:
        async with aiohttp.ClientSession() as http:
            await _until(
                lambda: (
                    sum(r.connected for s in scheduler.state.servers.values() for r in s.replicas.values())
                    == 2
                )
            )
            spec = {
                "name": "m",
                "storage_uri": "sim://m",
                "memory": 1000,
                "min_replicas": 1,
                "max_replicas": 2,
            }
            async with http.put(f"{scheduler.url}/v1/models/m", json=spec) as response:
                assert response.status == 200
            model = scheduler.state.models["m"]
            await _until(lambda: model.latest.status.state.value == "ModelAvailable")
            first = model.latest.server, set(model.latest.replicas)
            started = time.perf_counter()
            until = started + deadline

            async def client() -> None:
                while not stop.is_set() and time.perf_counter() < until:
                    async with http.post(f"{gateway.url}/v1/chat/completions", json=CHAT) as response:
                        await response.read()
                        backend = response.headers.get("X-Modelyard-Backend", "")
                        if backend and int(backend.rsplit("-", 1)[1]) not in first[1]:
                            marks.setdefault("served", time.perf_counter() - started)

            clients = [asyncio.create_task(client()) for _ in range(burst)]

            def sample() -> bool:
                if model.latest.spec.replicas == 2:
                    marks.setdefault("decided", time.perf_counter() - started)
                if model.latest.status.available == 2:
                    marks.setdefault("available", time.perf_counter() - started)
                return "served" in marks

            await _until(sample, deadline)
            stop.set()
            await asyncio.gather(*clients)
    finally:
        for agent in agents:
            await agent.stop()
        await gateway.stop()
        await scheduler.stop()
        for worker in workers:
            await worker.stop()
    return marks


def run_dynamics(console: Console, args: argparse.Namespace) -> None:
    reload_rows = []
    for delay in args.load_delays:
        result = asyncio.run(measure_reload(delay, args.reload_rounds))
        reload_rows.append((delay, result))
    table = Table(title=f"Lazy reload (medians of {2 * args.reload_rounds} requests)")
    for column in ("server load time", "warm request", "after eviction", "added", "added / load time"):
        table.add_column(column, justify="right")
    for _delay, r in reload_rows:
        added = r["cold"] - r["warm"]
        table.add_row(
            f"{r['server_load'] * 1000:.1f} ms",
            f"{r['warm'] * 1000:.2f} ms",
            f"{r['cold'] * 1000:.1f} ms",
            f"{added * 1000:.1f} ms",
            f"{added / r['server_load']:.2f}x",
        )
    console.print(table)

    runs = [asyncio.run(measure_scale_up(args.burst)) for _ in range(args.scale_runs)]
    table = Table(
        title=f"Scale-up reaction, default autoscaling settings (burst of {args.burst}; "
        f"medians of {args.scale_runs} runs)"
    )
    for column in ("decided", "new replica Available", "first request served there"):
        table.add_column(column, justify="right")

    def median(key: str) -> str:
        values = [r[key] for r in runs if key in r]
        return f"{statistics.median(values):.2f} s" if values else "never"

    table.add_row(median("decided"), median("available"), median("served"))
    console.print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--load-delays", type=float, nargs="+", default=[0.05, 0.2], help="the sim-worker's load time, s"
    )
    parser.add_argument("--reload-rounds", type=int, default=10)
    parser.add_argument("--burst", type=int, default=80, help="concurrent requests of the scale-up burst")
    parser.add_argument("--scale-runs", type=int, default=3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    run_dynamics(Console(), parser.parse_args())
