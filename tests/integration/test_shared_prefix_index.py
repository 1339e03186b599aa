"""prefix_aware's index shared between two gateways through a real redis-server: what one gateway
sent where, the other follows; without sharing nothing goes through Redis; Redis going away costs no
request."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from modelyard.gateway import RunningGateway
from modelyard.gateway.prefix_sharing import CHANNEL
from support import metric_value, model_config, wait_until

CHAT = "/v1/chat/completions"
SHARED = "modelyard_prefix_index_shared_total"


def prompt(n: int) -> str:
    """About 700 characters: 11 chunks of the index, distinct from the first one."""
    return f"conversation {n}: " + "the same long system prompt of this deployment, " * 14


async def backend(http: aiohttp.ClientSession, gateway: RunningGateway, content: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    async with http.post(gateway.url + CHAT, json=body) as response:
        assert response.status == 200, await response.text()
        return response.headers["X-Modelyard-Backend"]


async def two_gateways(
    sim_workers: Any, gateways: Any, url: str, **state: Any
) -> tuple[RunningGateway, RunningGateway, str]:
    """Two gateways over the same three sim workers (same endpoint names), both prefix_aware on
    one Redis; and the channel name they share on."""
    workers = await sim_workers(3)
    prefix = f"test-{uuid.uuid4().hex}:"
    config = {"backend": "redis", "url": url, "key_prefix": prefix, **state}
    models = [model_config("m", workers, strategy="prefix_aware")]
    gateway_a = await gateways(models, state=config, seed=1)
    gateway_b = await gateways(models, state=config, seed=2)
    return gateway_a, gateway_b, prefix + CHANNEL


async def wait_for_subscribers(url: str, channel: str, count: int) -> None:
    """Until `count` gateways listen on `channel`: a message published before is lost."""
    client = aioredis.Redis.from_url(url)
    try:

        async def subscribed() -> bool:
            ((_, listening),) = await client.pubsub_numsub(channel)
            return int(listening) == count

        await wait_until(subscribed)
    finally:
        await client.aclose()


async def wait_for_received(http: aiohttp.ClientSession, gateway: RunningGateway, at_least: int) -> None:
    async def received() -> bool:
        return await metric_value(http, gateway.url, SHARED, direction="received") >= at_least

    await wait_until(received, attempts=500, interval=0.02)


async def test_a_gateway_sends_a_prompt_where_another_gateway_sent_it(sim_workers, gateways, http, redis_url):
    gateway_a, gateway_b, channel = await two_gateways(sim_workers, gateways, redis_url)
    await wait_for_subscribers(redis_url, channel, 2)

    prompts = [prompt(n) for n in range(6)]  # a chance agreement on all: (1/3)^6
    on_a = [await backend(http, gateway_a, content) for content in prompts]
    await wait_for_received(http, gateway_b, len(prompts))
    on_b = [await backend(http, gateway_b, content) for content in prompts]

    assert on_b == on_a
    assert len(set(on_a)) > 1  # a fresh prompt goes to any endpoint: the agreement is learnt
    assert await metric_value(http, gateway_a.url, SHARED, direction="sent") >= len(prompts)
    assert await metric_value(http, gateway_a.url, SHARED, direction="dropped") == 0
    # A learns B's requests too; B's own records do not come back to it.
    await wait_for_received(http, gateway_a, len(prompts))
    assert await metric_value(http, gateway_b.url, SHARED, direction="received") == len(prompts)


async def test_without_sharing_gateways_neither_subscribe_nor_publish(
    sim_workers, gateways, http, redis_server
):
    """On a Redis of their own, two gateways with share_prefix_index off that served prompts never
    sent SUBSCRIBE or PUBLISH, and have no sharing series (a sharer makes them when built)."""
    gateway_a, gateway_b, channel = await two_gateways(
        sim_workers, gateways, redis_server.url, share_prefix_index=False
    )
    for n in range(4):
        for gateway in (gateway_a, gateway_b):
            await backend(http, gateway, prompt(n))

    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await client.pubsub_channels() == []
        assert await client.pubsub_numsub(channel) == [(channel.encode(), 0)]
        commands = await client.info("commandstats")
        assert not {"cmdstat_subscribe", "cmdstat_publish"} & commands.keys(), commands.keys()
    finally:
        await client.aclose()
    for gateway in (gateway_a, gateway_b):
        async with http.get(gateway.url + "/metrics") as response:
            assert SHARED + "{" not in await response.text()


async def test_requests_succeed_while_redis_is_away_and_sharing_resumes_when_it_returns(
    sim_workers, gateways, http, redis_server
):
    gateway_a, gateway_b, channel = await two_gateways(sim_workers, gateways, redis_server.url)
    await wait_for_subscribers(redis_server.url, channel, 2)
    await backend(http, gateway_a, prompt(0))
    await wait_for_received(http, gateway_b, 1)

    redis_server.stop()
    for n in range(1, 6):
        await backend(http, gateway_a, prompt(n))
        await backend(http, gateway_b, prompt(n + 100))

    async def dropped_on_a() -> bool:  # what A learnt while Redis was away was not sent
        return await metric_value(http, gateway_a.url, SHARED, direction="dropped") >= 1

    await wait_until(dropped_on_a)

    redis_server.start()  # both gateways subscribe again, after their backoff
    probes = iter(range(1000, 10_000))
    received = await metric_value(http, gateway_b.url, SHARED, direction="received")

    async def shared_again() -> bool:
        await backend(http, gateway_a, prompt(next(probes)))
        return await metric_value(http, gateway_b.url, SHARED, direction="received") > received

    await wait_until(shared_again, attempts=300, interval=0.1)
