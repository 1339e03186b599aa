"""Priority and fairness under overload, through a real gateway (auth on) and a real sim worker:
one endpoint taking one request at a time, so the order the answers come back in is the order
the queue served them. A tenant with one request waiting goes before another tenant's backlog; a
higher priority sheds the newest lowest-priority waiter of a full queue (429, OpenAI's envelope)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from modelyard.gateway import GATEWAY
from support import model_config, wait_until

CHAT = "/v1/chat/completions"
KEYS = {
    "tenants": [
        {"name": "a", "models": ["*"]},
        {"name": "b", "models": ["*"]},
        {"name": "batch", "models": ["*"], "priority": -10},
        {"name": "live", "models": ["*"], "priority": 10},
    ],
    "keys": [
        {"name": f"{t}-app", "tenant": t, "key": f"sk-test-{t}-0123456789"}
        for t in ("a", "b", "batch", "live")
    ],
}
BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def start(sim_workers, gateways, tmp_path: Path, max_pending: int) -> tuple[str, Any]:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(KEYS))
    # ~0.2 s a request: long enough for the test to queue the others behind the one in flight
    workers = await sim_workers(1, decode_ms_per_token=100.0)
    breakers = {"max_requests": 1, "max_pending_requests": max_pending, "queue_timeout": "30s"}
    gateway = await gateways(
        [model_config("chat", workers, circuit_breakers=breakers)],
        auth={"enabled": True, "keys_file": str(path)},
    )
    return gateway.url, gateway.app[GATEWAY].clusters["chat"]


class Answers:
    """Requests sent one after another, each once the gateway holds the one before (in flight or
    queued); `order` is the order their answers came back in."""

    def __init__(self, http: aiohttp.ClientSession, url: str, cluster: Any) -> None:
        self.http, self.url, self.cluster = http, url, cluster
        self.order: list[str] = []
        self.answers: dict[str, tuple[int, dict[str, Any]]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    async def send(self, name: str, tenant: str, *, sheds: bool = False) -> None:
        held = self._held()

        async def call() -> None:
            headers = {"Authorization": f"Bearer sk-test-{tenant}-0123456789"}
            async with self.http.post(self.url + CHAT, json=BODY, headers=headers) as response:
                self.answers[name] = (response.status, await response.json())
                self.order.append(name)

        self.tasks.append(asyncio.create_task(call()))

        async def taken() -> bool:  # in flight or queued (one that sheds takes another's place)
            return self._held() == held + (0 if sheds else 1) and (not sheds or len(self.order) > 0)

        await wait_until(taken)

    def _held(self) -> int:
        return sum(e.model_in_flight for e in self.cluster.endpoints) + len(self.cluster.capacity)

    async def all(self) -> list[str]:
        await asyncio.gather(*self.tasks)
        return self.order


async def test_a_tenant_with_one_request_waiting_is_served_before_a_flooding_tenants_queue(
    sim_workers, gateways, http, tmp_path
):
    url, cluster = await start(sim_workers, gateways, tmp_path, max_pending=10)
    answers = Answers(http, url, cluster)
    for name in ("a0", "a1", "a2", "a3"):  # a0 in flight, a1..a3 queued
        await answers.send(name, "a")
    await answers.send("b1", "b")
    assert await answers.all() == ["a0", "b1", "a1", "a2", "a3"]
    assert all(status == 200 for status, _ in answers.answers.values())


async def test_a_higher_priority_sheds_the_newest_low_priority_request_of_a_full_queue(
    sim_workers, gateways, http, tmp_path
):
    url, cluster = await start(sim_workers, gateways, tmp_path, max_pending=2)
    answers = Answers(http, url, cluster)
    for name in ("low0", "low1", "low2"):  # low0 in flight, low1 and low2 queued: the queue is full
        await answers.send(name, "batch")
    await answers.send("high", "live", sheds=True)
    assert answers.order == ["low2"]  # shed at once
    status, body = answers.answers["low2"]
    error = body["error"]
    assert status == 429 and error["code"] == "overloaded" and error["type"] == "rate_limit_error"
    assert "shed for higher-priority traffic" in error["message"]
    # another low-priority request finds the queue full of what it may not shed: refused
    headers = {"Authorization": "Bearer sk-test-batch-0123456789"}
    async with http.post(url + CHAT, json=BODY, headers=headers) as response:
        assert response.status == 429 and response.headers["Retry-After"] == "1"
        assert "already wait" in (await response.json())["error"]["message"]
    assert await answers.all() == ["low2", "low0", "high", "low1"]
    assert [answers.answers[n][0] for n in ("low0", "high", "low1")] == [200, 200, 200]
    async with http.get(url + "/metrics") as response:  # the tenant's two refused for room: shed
        assert 'modelyard_tenant_shed_total{tenant="batch"} 2.0' in await response.text()
