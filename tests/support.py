"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from modelyard.simworker import SimWorker


def model_config(name: str, workers: list[SimWorker], **fields: Any) -> dict[str, Any]:
    """A model over `workers`, endpoints named w0, w1, ... in order."""
    endpoints = [{"name": f"w{i}", "url": w.url} for i, w in enumerate(workers)]
    return {"name": name, "endpoints": endpoints, "health_check": {"interval": "60s"}, **fields}


async def wait_until(predicate: Any, *, attempts: int = 500, interval: float = 0.01) -> None:
    """Poll an async predicate until it holds; fails after attempts x interval seconds."""
    for _ in range(attempts):
        if await predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError("condition not reached in time")


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all held open until every one is chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


async def sim_stats(http: aiohttp.ClientSession, worker: SimWorker) -> dict[str, Any]:
    async with http.get(worker.url + "/sim/stats") as response:
        return await response.json()


async def metric_value(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample at `url`/metrics (0.0 when absent)."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        sample, _, value = line.rpartition(" ")
        if sample == name or (
            sample.startswith(name + "{") and all(f'{k}="{v}"' in sample for k, v in labels.items())
        ):
            return float(value)
    return 0.0


async def scheduler_model(http: aiohttp.ClientSession, scheduler_url: str, name: str) -> dict[str, Any]:
    """`GET /v1/models/{name}` from a scheduler, asserting it answered 200."""
    async with http.get(f"{scheduler_url}/v1/models/{name}") as response:
        assert response.status == 200, await response.text()
        return dict(await response.json())


async def wait_for_model(
    http: aiohttp.ClientSession, scheduler_url: str, name: str, check: Any, what: str, within: float = 30
) -> dict[str, Any]:
    """Poll the scheduler's view of `name` until `check(model)` holds; the model then. Fails naming
    `what` and the last model seen after `within` seconds."""
    seen: dict[str, Any] = {}

    async def reached() -> bool:
        seen.clear()
        seen.update(await scheduler_model(http, scheduler_url, name))
        return bool(check(seen))

    try:
        await wait_until(reached, attempts=int(within / 0.05), interval=0.05)
    except AssertionError:
        raise AssertionError(f"{name}: {what} never happened; last: {json.dumps(seen)}") from None
    return seen


def run_modelyard(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`modelyard ARGS` as a user runs it (this checkout's code), its output captured; a wide
    terminal so that rich does not wrap the lines the tests read."""
    return subprocess.run(
        [sys.executable, "-m", "modelyard", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "250"},
    )


async def wait_answering(http: aiohttp.ClientSession, url: str, process: asyncio.subprocess.Process) -> None:
    """Until `url` answers 200 (a server `process` started); fails if the process exits first."""

    async def answering() -> bool:
        try:
            async with http.get(url) as response:
                return response.status == 200
        except aiohttp.ClientError:
            return process.returncode is not None

    await wait_until(answering, attempts=3000)
    assert process.returncode is None, f"exited with {process.returncode} before {url} answered"


# circuit_breakers for a model with one slot: a second request waits in its queue
ONE_SLOT = {"max_requests": 1, "max_pending_requests": 4, "queue_timeout": "30s"}


async def cancel_while_queued(http: aiohttp.ClientSession, url: str, cluster: Any, request_id: str) -> None:
    """A client that gives up while its request waits for room: with the model's one slot
    (ONE_SLOT) held by a stream, the request named `request_id` is queued, then cancelled; returns
    once it has left the queue, the stream still open."""
    chat = "/v1/chat/completions"

    def body(**extra: object) -> dict[str, object]:
        return {"model": cluster.name, "messages": [{"role": "user", "content": "hello"}], **extra}

    long = body(max_tokens=100_000, stream=True)
    async with http.post(url + chat, json=long, headers={"X-Request-Id": "long"}) as first:
        await first.content.readline()  # it holds the one slot
        queued = asyncio.create_task(
            http.post(url + chat, json=body(max_tokens=3), headers={"X-Request-Id": request_id})
        )

        async def waiting() -> bool:
            return len(cluster.capacity) == 1

        await wait_until(waiting)
        queued.cancel()
        try:
            await queued
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the queued request was answered: it was never cancelled while queued")

        async def gone() -> bool:
            return len(cluster.capacity) == 0

        await wait_until(gone)
