"""`listen.busy_poll` on a running gateway: the lean listener's requests keep its loop polling for
the window after they begin and end, not while several are answered, however a request ends, and
not once the server stops."""

from __future__ import annotations

import asyncio

import orjson

from raw_http import read_reply, request
from support import model_config, wait_until

CHAT = "/v1/chat/completions"
# 16 output tokens at the sim worker's 20 ms each: a request in flight for about a third of a second.
CHAT_BODY = orjson.dumps({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
LISTEN = {"host": "127.0.0.1", "port": 0}


async def test_it_is_off_unless_set(sim_workers, gateways):
    workers = await sim_workers(1)
    default = await gateways([model_config("m", workers)])
    aiohttp_only = await gateways(
        [model_config("m", workers)], listen={**LISTEN, "busy_poll": "1ms", "lean": False}
    )
    assert default.server.busy_poll is None
    assert aiohttp_only.server.busy_poll is None  # it follows the lean listener's requests only


async def test_it_polls_around_one_request_not_two_and_stops_with_the_server(sim_workers, gateways, clients):
    workers = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("m", workers)], listen={**LISTEN, "busy_poll": "1s"})
    busy = gateway.server.busy_poll
    assert busy is not None and not busy.polling

    first = await clients(gateway.url)
    reply = await first.exchange(request("POST", CHAT, CHAT_BODY))
    assert reply.status == 200, reply.body
    assert busy.polling and busy.answering == 0  # for a second after the answer: the next request

    second = await clients(gateway.url)
    await first.send(request("POST", CHAT, CHAT_BODY))
    await second.send(request("POST", CHAT, CHAT_BODY))

    async def both_answered_and_not_polling() -> bool:
        return busy.answering == 2 and not busy.polling

    await wait_until(both_answered_and_not_polling)  # their own traffic keeps the loop awake
    replies = [await read_reply(first.reader), await read_reply(second.reader)]
    assert [r.status for r in replies] == [200, 200]
    assert busy.answering == 0 and busy.polling

    # A client that leaves mid-request ends its answer too: nothing is left counted.
    third = await clients(gateway.url)
    await third.send(request("POST", CHAT, CHAT_BODY))

    async def answering_one() -> bool:
        return busy.answering == 1

    await wait_until(answering_one)
    third.close()

    async def none_answering() -> bool:
        return busy.answering == 0

    await wait_until(none_answering)

    await gateway.stop()
    busy.begin()  # (as a request would: a stopped server's poller never starts again)
    for _ in range(3):
        await asyncio.sleep(0)
    assert not busy.polling
