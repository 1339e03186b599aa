"""The official openai client, pointed at the gateway, against sim workers."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest
from aiohttp import web

from support import model_config


@pytest.fixture
async def client(sim_workers, gateways):
    workers = await sim_workers(2)
    gateway = await gateways([model_config("demo-llm", workers)])
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


async def test_chat_completion(client):
    response = await client.chat.completions.create(
        model="demo-llm", messages=[{"role": "user", "content": "Say hello"}], max_tokens=5
    )
    assert response.model == "demo-llm"
    assert response.choices[0].message.role == "assistant"
    assert len(response.choices[0].message.content.split()) == 5
    assert response.usage.completion_tokens == 5
    assert response.usage.prompt_tokens > 0


async def test_chat_completion_raw_headers_name_backend_and_strategy(client):
    raw = await client.chat.completions.with_raw_response.create(
        model="demo-llm", messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["x-modelyard-backend"] in {"w0", "w1"}
    assert raw.headers["x-modelyard-strategy"] == "round_robin"
    assert raw.headers["x-request-id"]


async def test_chat_streaming(client):
    stream = await client.chat.completions.create(
        model="demo-llm", messages=[{"role": "user", "content": "stream please"}], max_tokens=6, stream=True
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 6
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


async def test_completions(client):
    response = await client.completions.create(model="demo-llm", prompt="Once upon a time", max_tokens=3)
    assert len(response.choices[0].text.split()) == 3
    assert response.usage.prompt_tokens == 4


async def test_embeddings(client):
    response = await client.embeddings.create(model="demo-llm", input=["alpha", "beta"])
    assert [d.index for d in response.data] == [0, 1]
    assert len(response.data[0].embedding) > 0
    again = await client.embeddings.create(model="demo-llm", input="alpha")
    assert again.data[0].embedding == response.data[0].embedding


async def test_models_list(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["demo-llm"]


async def test_unknown_model_is_openai_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "demo-llm" in info.value.body["message"]
    assert info.value.body["code"] == "model_not_found"


async def test_a_stream_cut_by_a_dying_backend_raises_in_the_client(gateways):
    """The gateway ends a broken stream with an error event; the SDK raises on it, mid-iteration,
    instead of handing over half an answer as if it were whole."""
    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "demo-llm",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "half"}, "finish_reason": None}],
    }

    async def dies_mid_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        assert request.transport is not None
        request.transport.abort()
        raise asyncio.CancelledError

    app = web.Application()
    app.router.add_post("/v1/chat/completions", dies_mid_stream)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        gateway = await gateways(
            [{"name": "demo-llm", "endpoints": [{"url": url}], "health_check": {"interval": 0}}]
        )
        async with openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key="unused", max_retries=0
        ) as client:
            stream = await client.chat.completions.create(
                model="demo-llm", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            received = []
            with pytest.raises(openai.APIError, match="closed the connection"):
                async for part in stream:
                    received.append(part.choices[0].delta.content)
        assert received == ["half"]
    finally:
        await runner.cleanup()
