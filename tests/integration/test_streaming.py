"""Streams are relayed as they arrive, and a client that leaves cancels the upstream request."""

from __future__ import annotations

import asyncio

import orjson

from support import metric_value, model_config, sim_stats, wait_until

CHAT = "/v1/chat/completions"


async def test_first_chunk_arrives_while_the_stream_is_still_running(sim_workers, gateways, http):
    (worker,) = await sim_workers(1, decode_ms_per_token=10.0)
    gateway = await gateways([model_config("m", [worker])])
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 40,
        "stream": True,
    }
    async with http.post(gateway.url + CHAT, json=body) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["X-Modelyard-Backend"] == "w0"
        first = await response.content.readline()
        # Events in order: first chunk received -> upstream still generating -> stream ends.
        stats_at_first_chunk = await sim_stats(http, worker)
        rest = await response.read()
    assert first.startswith(b"data: {")
    assert stats_at_first_chunk["running"] == 1
    assert stats_at_first_chunk["completion_tokens_total"] < 40
    events = [line for line in (first + rest).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 40


async def test_client_disconnect_cancels_the_upstream_stream(sim_workers, gateways, http):
    (worker,) = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("m", [worker])])
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 100000,
        "stream": True,
    }
    response = await http.post(gateway.url + CHAT, json=body)
    await response.content.readline()
    assert (await sim_stats(http, worker))["running"] == 1
    response.close()

    async def upstream_stopped() -> bool:
        return (await sim_stats(http, worker))["running"] == 0

    # 100000 tokens x 20 ms would run for half an hour: only the cancellation can end it in time.
    await wait_until(upstream_stopped)


async def test_client_disconnect_cancels_a_non_streaming_request(sim_workers, gateways, http):
    (worker,) = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("m", [worker])])
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}
    task = asyncio.create_task(http.post(gateway.url + CHAT, json=body))

    async def upstream_running() -> bool:
        return (await sim_stats(http, worker))["running"] == 1

    await wait_until(upstream_running)
    task.cancel()

    async def upstream_stopped() -> bool:
        gateway_idle = await metric_value(http, gateway.url, "modelyard_backend_in_flight", backend="w0") == 0
        return gateway_idle and (await sim_stats(http, worker))["running"] == 0

    await wait_until(upstream_stopped)


async def test_a_client_leaving_a_fast_stream_is_counted_not_logged_as_an_error(
    sim_workers, gateways, http, caplog
):
    # The server streams as fast as it can: the gateway is mid-write when the client's socket
    # closes, which must end the exchange quietly (499), not as an unhandled error.
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])])
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 100_000,
        "stream": True,
    }
    for _ in range(5):
        response = await http.post(gateway.url + CHAT, json=body)
        await response.content.readline()
        response.close()

    async def all_ended() -> bool:
        return await metric_value(http, gateway.url, "modelyard_requests_total", code="499") == 5

    await wait_until(all_ended)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
