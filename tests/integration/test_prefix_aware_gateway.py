"""prefix_aware as the gateway drives its Balancer over real sim-workers: each try sent is a flight
until its answer ends, and only answers relayed whole teach the service time."""

from __future__ import annotations

import asyncio

from modelyard.gateway.gateway import GATEWAY
from support import model_config, wait_until

CHAT = "/v1/chat/completions"


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def learn_the_line(gateway, http, balancer) -> None:
    for i in range(9):  # one at a time: each starts on an idle server and is timed
        async with http.post(gateway.url + CHAT, json=chat(f"q{i} " + "x" * (50 * i), max_tokens=1)) as r:
            assert r.status == 200
            await r.read()
    assert balancer.service.line() is not None


async def test_a_request_in_flight_is_a_flight_until_its_answer_and_the_answer_is_learnt(
    sim_workers, gateways, http
):
    workers = await sim_workers(2, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("m", workers, strategy="prefix_aware")])
    balancer = gateway.app[GATEWAY].clusters["m"].balancer
    await learn_the_line(gateway, http, balancer)
    learnt = balancer.service.samples

    async def slow() -> int:
        async with http.post(gateway.url + CHAT, json=chat("a slow one", max_tokens=20)) as r:
            await r.read()
            return r.status

    answer = asyncio.create_task(slow())

    async def in_flight() -> bool:
        return sum(balancer.flights.count(name) for name in ("w0", "w1")) == 1

    await wait_until(in_flight)  # sent through the attempt loop: the balancer was told
    assert await answer == 200
    assert not balancer.flights  # its answer ended it
    assert balancer.service.samples == learnt + 1


async def test_a_stream_that_goes_idle_after_its_200_teaches_nothing(sim_workers, gateways, http):
    workers = await sim_workers(1, decode_ms_per_token=200.0)
    routes = [{"name": "r", "destinations": [{"subset": "default"}], "stream_idle_timeout": "50ms"}]
    gateway = await gateways([model_config("m", workers, strategy="prefix_aware", routes=routes)])
    balancer = gateway.app[GATEWAY].clusters["m"].balancer
    await learn_the_line(gateway, http, balancer)
    learnt = (balancer.service.samples, balancer.lateness.seen)
    async with http.post(gateway.url + CHAT, json=chat("streamed", max_tokens=50, stream=True)) as r:
        assert r.status == 200
        body = await r.read()
    assert b"upstream_timeout" in body  # the client was told the stream ended in an error
    assert not balancer.flights
    assert (balancer.service.samples, balancer.lateness.seen) == learnt  # its time is the timeout's
